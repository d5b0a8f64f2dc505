"""Paged decode attention, 12 rows of 1,200 tokens whose first 1,024 are one shared prefix (the same pages) or each
row's own copy; 30 layers of SmolLM2's shape (9 over 3 heads of 64), float32. Seconds a step, and GB/s counting
every row's reads."""
import time, torch
from repertory.models.decode import paged_decode_attention
torch.manual_seed(0)
B, Hq, Hkv, D, P, layers = 12, 9, 3, 64, 128, 30
prefix, total = 1024, 1200
own = (total + P - 1) // P
count = B * own + 8
kp = [torch.randn(count, Hkv, P, D) for _ in range(layers)]
vp = [torch.randn(count, Hkv, P, D) for _ in range(layers)]
perm = torch.randperm(count)
distinct = perm[: B * own].view(B, own)
shared = distinct.clone()
shared[:, : prefix // P] = distinct[0, : prefix // P]
q = torch.randn(B, Hq, 1, D)
lengths = torch.full((B,), total)
def step(table):
    for l in range(layers):
        paged_decode_attention(q, kp[l], vp[l], table, lengths)
def timed(table, n=7):
    step(table)
    t = time.perf_counter()
    for _ in range(n):
        step(table)
    return (time.perf_counter() - t) / n
bytes_read = 2 * B * Hkv * total * D * 4 * layers
for name, table in (("distinct", distinct), ("shared", shared), ("distinct", distinct), ("shared", shared)):
    s = timed(table)
    print(f"{name}: {s * 1e3:.1f} ms a step, {bytes_read / s / 1e9:.1f} GB/s of row reads")
