"""Run presets (indoor.yaml, outdoor.yaml, low-memory.yaml), installed as stream_recon.configs.

A package only so that the YAML files travel in the wheel as package data; app/run/presets.py reads
them through importlib.resources, the same way in a checkout, an editable install and a wheel.
"""
