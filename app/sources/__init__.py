"""The sources: frames in, from what the user typed, one at a time.

Owns opening a source (opening: a video file, an image folder, a webcam, a stream URL classified and checked
before any model loads), the reader thread and its hand-off (reader: decoding, the stall past the frame
timeout, reconnection of a live source), the preprocessing pool (preprocessing_pool: which frames it takes,
its threads, its policy), the decoders of each kind of source (readers),
a delivered frame and a source's error (frames), asking a stream's server why it gave no frame
(probing), telling a file that is not a video by its first bytes (signatures), the crop rule that makes a
model input (preprocess), the input size (input_size) and the source flags' settings (settings).

May import: the shared modules at app/'s top (options, stopping) and stream_recon.models.
Imports nothing of: run, outputs, evaluation, viewer, commands.
"""
