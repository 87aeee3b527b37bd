# Throwaway GPU probe: where a masked SD3-medium step's time goes (not part of the project).
import sys, time, torch
sys.path.insert(0, "bench")
import bench_train as bt
dev = torch.device("cuda")
config = bt.mmdit_config(False)
def timed(fn, n=5):
    for _ in range(2): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e3
for res, bs in ((256, 32), (512, 8)):
    torch.manual_seed(0)
    unet = bt.build_unet(config, device=dev).train()
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4, fused=True)
    batch = bt.synthetic_batch(config, bs, res, dev)
    ac = torch.autocast("cuda", dtype=torch.bfloat16)
    shapes = []
    h = unet.transformer_blocks[5].register_forward_pre_hook(lambda m, a, k: shapes.append(tuple((k.get("hidden_states") if "hidden_states" in k else a[0]).shape)), with_kwargs=True)
    for ratio in (0.0, 0.75):
        keep = bt.masked_keep(config, bs, res, ratio, dev)
        adapter = bt.adapter_of(config)
        def fwd():
            with ac, torch.no_grad():
                adapter(unet, batch[0], batch[2], batch[1], keep=keep, mixer_blocks=2)
        def step():
            bt.train_step(unet, opt, batch, ac, None, keep=keep, mixer_blocks=2)
        def fwdbwd():
            with ac:
                p = adapter(unet, batch[0], batch[2], batch[1], keep=keep, mixer_blocks=2)
            p.float().pow(2).mean().backward(); unet.zero_grad(set_to_none=True)
        def optonly():
            for p in unet.parameters(): p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            opt.step()
        shapes.clear()
        f = timed(fwd); s0 = shapes[-1]
        fb = timed(fwdbwd); st = timed(step); o = timed(optonly); unet.zero_grad(set_to_none=True)
        print(f"res {res} bs {bs} ratio {ratio}: block5 tokens {s0}; fwd {f:.1f} ms, fwd+bwd {fb:.1f} ms, opt {o:.1f} ms, train_step {st:.1f} ms", flush=True)
    h.remove()
    from torch.profiler import profile, ProfilerActivity
    keep = bt.masked_keep(config, bs, res, 0.75, dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2): bt.train_step(unet, opt, batch, ac, None, keep=keep, mixer_blocks=2)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60), flush=True)
    del unet, opt; torch.cuda.empty_cache()
