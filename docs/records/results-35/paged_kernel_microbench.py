import torch, time
from repertory.models.decode import paged_decode_attention, decode_attention
torch.manual_seed(0)
B,Hq,Hkv,D,T,P=12,9,3,64,2400,128
layers=30
npages=(T+P-1)//P
kp=[torch.randn(B*npages+5,Hkv,P,D) for _ in range(layers)]; vp=[torch.randn(B*npages+5,Hkv,P,D) for _ in range(layers)]
perm=torch.randperm(B*npages+5)[:B*npages].view(B,npages)
kc=[torch.randn(B,Hkv,T+100,D)[:,:,:T] for _ in range(layers)]; vc=[torch.randn(B,Hkv,T+100,D)[:,:,:T] for _ in range(layers)]
q=torch.randn(B,Hq,1,D); lengths=torch.full((B,),T); mask=torch.ones(B,1,1,T,dtype=torch.bool)
def run(f, n=5):
    f(); t=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-t)/n
pc=run(lambda: [decode_attention(q,kc[l],vc[l],mask) for l in range(layers)])
pp=run(lambda: [paged_decode_attention(q,kp[l],vp[l],perm,lengths) for l in range(layers)])
byt=2*B*Hkv*T*D*4*layers
print(f"contig {pc*1e3:.1f} ms {byt/pc/1e9:.1f} GB/s; paged {pp*1e3:.1f} ms {byt/pp/1e9:.1f} GB/s")
