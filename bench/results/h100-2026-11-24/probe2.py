# Throwaway GPU probe: masked SD3-medium steps at larger per-GPU batches (eager).
import sys, time, torch
sys.path.insert(0, "bench")
import bench_train as bt
dev = torch.device("cuda")
config = bt.mmdit_config(False)
torch.manual_seed(0)
unet = bt.build_unet(config, device=dev).train()
opt = torch.optim.AdamW(unet.parameters(), lr=1e-4, fused=True)
ac = torch.autocast("cuda", dtype=torch.bfloat16)
for res, bs, ratio in ((256, 32, 0.0), (256, 32, 0.75), (256, 64, 0.75), (256, 96, 0.75), (512, 8, 0.0), (512, 8, 0.75), (512, 16, 0.75), (512, 32, 0.75)):
    try:
        batch = bt.synthetic_batch(config, bs, res, dev)
        keep = bt.masked_keep(config, bs, res, ratio, dev)
        step = lambda: bt.train_step(unet, opt, batch, ac, None, keep=keep, mixer_blocks=2)
        for _ in range(2): step()
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); t = time.perf_counter()
        for _ in range(6): step()
        torch.cuda.synchronize(); ms = (time.perf_counter() - t) / 6 * 1e3
        g = bt.count_gflop_per_image(config, res, ratio, 2)
        print(f"res {res} bs {bs:3d} ratio {ratio}: {ms:7.1f} ms/step  {bs/ms*1e3:7.1f} img/s  {g:7.1f} GFLOP/img  {g*bs/ms:6.1f} TFLOP/s  peak mem {torch.cuda.max_memory_allocated()/2**30:.1f} GiB", flush=True)
    except torch.OutOfMemoryError:
        print(f"res {res} bs {bs} ratio {ratio}: out of memory", flush=True)
    opt.zero_grad(set_to_none=True); batch = keep = None; torch.cuda.empty_cache()
