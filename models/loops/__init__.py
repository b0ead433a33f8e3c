"""Loop closure: the drift of a chunked stream corrected where the camera comes back.

Owns: keyframe retrieval (retrieval.py), the geometric check (geometric_check.py), detection (detection.py),
the 3D verification and the synchronous core (closer.py), the pose graph over chunks (pose_graph.py, its solver;
its edges, graph, settings and result in pose_graph_data.py, the conversions to GTSAM in gtsam_sim3.py; the
checks of its loops in consistency.py, cliques.py and leave_one_out.py, Sim(3) on stacks in sim3_batch.py),
what a solve means for the outputs (corrections.py), the child process the stream runs the core in
(process.py), the saved map a run leaves to be reopened (saved_map.py), a finished run refined offline on
a graph finer than its chunks (refine.py), and query frames placed in a finished run's map (localise.py). Imports from the rest of models/: similarity (Sim3), pose
(back-projection), chunks (ChunkLink), prediction (FramePrediction), child_process and supervision; never the
engine or the network.
docs/loop_closure.md has the rules and the numbers.
"""
