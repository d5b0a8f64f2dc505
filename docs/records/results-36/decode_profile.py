"""Where a decode pass's time goes: SmolLM2, 12 paged rows of about 1,000 cached tokens, 40 decode steps,
torch.profiler: the linear layers, the decode-attention kernel, the other ops (glue), and what no op accounts for
(Python and dispatch)."""
import time, torch
from torch.profiler import profile, ProfilerActivity
from repertory.models import load_model
from repertory.generation.hf import HFBackend
from repertory.generation import SamplingParams
loaded = load_model("smollm2")
tok = loaded.tokenizer
backend = HFBackend(loaded)
prompts = [tok.encode(("Round %d of 10. You offered 3 and they offered 4. " % i) * 55) for i in range(12)]
stream = backend.stream(SamplingParams(temperature=1.0, max_new_tokens=60))
for seed, prompt in enumerate(prompts):
    stream.add(prompt, seed)
for _ in range(5):
    stream.step()  # the join and a few decode steps
steps = 40
start = time.perf_counter()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(steps):
        stream.step()
wall = time.perf_counter() - start
groups = {"linear": 0.0, "attention": 0.0, "glue": 0.0}
for event in prof.key_averages():
    if event.key.startswith(("mkldnn::_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm")):
        groups["linear"] += event.self_cpu_time_total
    elif "paged_decode_attention" in event.key:
        groups["attention"] += event.self_cpu_time_total
    elif event.key.startswith(("aten::", "mkldnn::", "repertory::")):
        groups["glue"] += event.self_cpu_time_total
total_ops = sum(groups.values()) / 1e6
print(f"{steps} steps in {wall:.2f} s under the profiler ({wall / steps * 1e3:.1f} ms a step)")
for name, us in groups.items():
    print(f"{name}: {us / 1e6:.2f} s, {us / 1e6 / wall:.1%}")
print(f"outside ops (Python, dispatch, profiler): {wall - total_ops:.2f} s, {(wall - total_ops) / wall:.1%}")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
