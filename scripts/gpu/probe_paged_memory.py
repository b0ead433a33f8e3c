"""Where does GPU memory grow over 2,000 frames on the paged FlashInfer path? (tiny model)"""

import torch

from stream_recon.models import GCTStream, ModelConfig, StreamConfig, StreamingEngine
from stream_recon.models.synthetic import load_synthetic_weights

for graphs, compiled in [(False, False), (True, False), (False, True)]:
    config = ModelConfig.from_dict({**ModelConfig.tiny().to_dict(), "max_frames": 2100})
    model = load_synthetic_weights(GCTStream(config)).cuda().eval()
    engine = StreamingEngine(model, StreamConfig(scale_frames=8, window=64, attention="flashinfer", cuda_graphs=graphs,
                                                 compile=compiled), device="cuda", dtype=torch.bfloat16)
    image = torch.rand(3, 126, 224, device="cuda")
    marks = {}
    for i in range(2000):
        engine.push(image)
        if i + 1 in (100, 500, 1000, 2000):
            marks[i + 1] = torch.cuda.memory_allocated() / 2**20
    print(f"graphs={graphs} compile={compiled}: MiB allocated {marks}", flush=True)
    del engine, model
    torch.cuda.empty_cache()
