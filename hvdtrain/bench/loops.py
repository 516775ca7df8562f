"""Hand-written training loops that hvdtrain is measured against (``python -m hvdtrain bench overhead|ddp``).

Each is the loop a user would write without hvdtrain, as short as Horovod's and PyTorch's own examples: the same model
(the recipe's builder), the same fixed synthetic batch, optimizer and threads as ``hvdtrain recipe R --synthetic``,
and nothing else. Run under a launcher:

    horovodrun -np 2 python -m hvdtrain.bench.loops horovod-torch --recipe mnist --steps 60 --result r.json
    horovodrun -np 2 python -m hvdtrain.bench.loops horovod-mxnet --recipe mnist --steps 60 --result r.json
    torchrun --nproc_per_node 2 -m hvdtrain.bench.loops ddp-torch --recipe mnist --steps 60 --result r.json
    python -m hvdtrain.bench.loops loader --recipe imagenet --steps 50 --result r.json -- --data-dir D --framework mxnet

``loader`` is the input pipeline alone: the recipe's own training data and its backend's loader, exactly as the
Trainer builds them (one process, world size 1), iterated without training; the options after ``--`` go to the
recipe.

Throughput is timed like the Trainer's epoch, after ``--warmup`` untimed steps (allocation, MXNet's graph caching,
Horovod's first negotiations): from the first timed step to the last, every step reading its loss back (as a loop
that logs does). Rank 0 writes ``{"images_per_sec": global img/s, ...}`` to ``--result``; every rank writes its CPU
seconds per timed step (all of its threads, and by thread role: :mod:`hvdtrain.threads`) to ``--result``.rankN.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..backends.gluoncv_compat import import_mxnet
from ..threads import ROLES, ThreadCpu, created_by, per_step


def _recipe(name: str, framework: str, batch_size: int, threads: int, recipe_args=()):
    """The recipe's Trainer for its model and shapes; ``recipe_args`` are its own options (--model, --image-size)."""
    from .. import registry
    from ..config import parse_overrides
    cls = registry.load(name)
    return cls(parse_overrides(cls.config_class, [*recipe_args, "--framework", framework, "--batch-size",
                                                  str(batch_size), "--threads", str(threads), "--synthetic",
                                                  "--output-dir", os.devnull]))


def _torch_steps(model, opt, trainer, args, device, synchronize=lambda: None, step=None) -> float:
    """Seconds for ``args.steps`` steps on one fixed synthetic batch, each reading its loss back. ``--precision``
    fp16 / bf16: autocast, and for fp16 a GradScaler (``step`` does the optimizer's part of a step)."""
    import contextlib
    import torch
    import torch.nn.functional as F
    x = torch.randn((args.batch_size,) + tuple(trainer.input_shape), device=device)
    y = torch.randint(0, trainer.num_classes, (args.batch_size,), device=device)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.precision)
    scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None
    model.train()
    synchronize()
    phases = args.phase_seconds = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            synchronize()
            start, cpu, args.window = time.perf_counter(), time.process_time(), [time.time()]
            args.thread_cpu.start()
            phases.update(dict.fromkeys(phases, 0.0))
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        (scaler.scale(loss) if scaler else loss).backward()  # DDP: with its allreduces' wait
        t2 = time.perf_counter()
        if step is not None:
            step(opt, scaler)
        elif scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()  # Horovod: with its allreduces' wait (synchronize)
        loss.item()
        t3 = time.perf_counter()
        for name, seconds in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2)):
            phases[name] += seconds
    synchronize()
    args.cpu_seconds = time.process_time() - cpu
    args.threads = args.thread_cpu.stop()
    args.window.append(time.time())
    return time.perf_counter() - start


def _gluon_model(args):
    """The recipe's Gluon network, initialized with shapes resolved, and one fixed synthetic batch."""
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    mx = import_mxnet()
    trainer = _recipe(args.recipe, "mxnet", args.batch_size, args.threads, args.recipe_args)
    mx.random.seed(trainer.cfg.seed)
    ctx = mx.cpu()
    net = trainer.build_mxnet()
    net.initialize(mx.init.Xavier(), ctx=ctx)
    x = mx.nd.random.normal(shape=(args.batch_size,) + tuple(trainer.input_shape), ctx=ctx)
    y = mx.nd.array(mx.nd.random.randint(0, trainer.num_classes, shape=(args.batch_size,)).asnumpy(), ctx=ctx)
    with mx.autograd.record():
        net(x)  # resolve deferred shapes before parameters are broadcast or pushed
    return trainer, net, x, y


def _gluon_steps(net, opt, x, y, args, normalize: int) -> float:
    """Seconds for ``args.steps`` Gluon steps after ``args.warmup`` untimed ones, each reading its loss back;
    ``opt.step(normalize)``."""
    import mxnet as mx
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    mx.nd.waitall()
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            mx.nd.waitall()
            start, cpu, args.window = time.perf_counter(), time.process_time(), [time.time()]
            args.thread_cpu.start()
        with mx.autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        opt.step(normalize)
        loss.mean().asscalar()
    mx.nd.waitall()
    args.cpu_seconds = time.process_time() - cpu
    args.threads = args.thread_cpu.stop()
    args.window.append(time.time())
    return time.perf_counter() - start


def _torch_model(args, size: int, device):
    """The recipe's PyTorch model on ``device`` and its SGD optimizer (learning rate scaled by ``size``)."""
    import torch
    torch.set_num_threads(args.threads)
    trainer = _recipe(args.recipe, "torch", args.batch_size, args.threads, args.recipe_args)
    cfg = trainer.cfg
    torch.manual_seed(cfg.seed)
    model = trainer.build_torch().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.base_lr * size, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    return trainer, model, opt


def horovod_torch(args) -> dict:
    """Horovod's PyTorch example loop: a GPU per rank by local rank, broadcast, DistributedOptimizer; with fp16 the
    GradScaler order Horovod documents (synchronize, unscale, step inside skip_synchronize)."""
    import torch
    import horovod.torch as hvd
    with created_by("horovod", "transport"):
        hvd.init()
    device, synchronize = torch.device("cpu"), (lambda: None)
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        device, synchronize = torch.device("cuda", hvd.local_rank()), torch.cuda.synchronize
    trainer, model, opt = _torch_model(args, hvd.size(), device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

    def step(opt, scaler):
        if scaler is None:
            opt.step()
            return
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()

    return {"rank": hvd.rank(), "size": hvd.size(),
            "seconds": _torch_steps(model, opt, trainer, args, device, synchronize, step)}


def horovod_mxnet(args) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import horovod.mxnet as hvd
    with created_by("horovod", "transport"):
        hvd.init()
    trainer, net, x, y = _gluon_model(args)
    cfg = trainer.cfg
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)
    net.hybridize()
    opt = hvd.DistributedTrainer(params, "sgd", {"learning_rate": cfg.base_lr * hvd.size(), "momentum": cfg.momentum,
                                                 "wd": cfg.weight_decay})
    return {"rank": hvd.rank(), "size": hvd.size(), "seconds": _gluon_steps(net, opt, x, y, args, args.batch_size)}


def single_mxnet(args) -> dict:
    """The Gluon loop in one process, no Horovod and no kvstore: the common single-worker baseline against which
    every distributed arm's scaling efficiency is taken."""
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    mx = import_mxnet()
    trainer, net, x, y = _gluon_model(args)
    cfg = trainer.cfg
    net.hybridize()
    opt = mx.gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": cfg.base_lr, "momentum": cfg.momentum,
                                                         "wd": cfg.weight_decay}, kvstore=None)
    return {"rank": 0, "size": 1, "seconds": _gluon_steps(net, opt, x, y, args, args.batch_size)}


def ps_mxnet(args) -> dict:
    """The Gluon loop on MXNet's parameter server (kvstore dist_sync): start it as a worker, with the scheduler and
    servers running and DMLC_* set (``bench ps`` does all of that)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    mx = import_mxnet()
    kv = mx.kv.create("dist_sync")
    trainer, net, x, y = _gluon_model(args)
    cfg = trainer.cfg
    net.hybridize()
    # The servers sum the workers' gradients and update the weights (update_on_kvstore, the default for dist_sync);
    # step(batch x workers) makes it the mean, as Horovod's average.
    opt = mx.gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": cfg.base_lr * kv.num_workers,
                                                         "momentum": cfg.momentum, "wd": cfg.weight_decay}, kvstore=kv)
    return {"rank": kv.rank, "size": kv.num_workers,
            "seconds": _gluon_steps(net, opt, x, y, args, args.batch_size * kv.num_workers)}


def ddp_torch(args) -> dict:
    import torch
    import torch.distributed as dist
    with created_by(None, "transport"):  # c10d's Gloo threads
        dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    trainer, model, opt = _torch_model(args, size, torch.device("cpu"))
    # broadcasts rank 0's parameters; --bucket-cap-mb: DDP's gradient buckets (its default 25 MB when not given)
    buckets = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    model = torch.nn.parallel.DistributedDataParallel(model, **buckets)
    runs: list = []
    if args.bucket_times:
        model.register_comm_hook(None, _timed_allreduce(runs))
    seconds = _torch_steps(model, opt, trainer, args, torch.device("cpu"))
    dist.barrier()  # no rank tears the group down while its peer still talks to it (a SIGABRT was seen)
    dist.destroy_process_group()
    out = {"rank": rank, "size": size, "seconds": seconds}
    if args.bucket_times:
        from ..timeline import summarize_transfers
        out["timeline"] = summarize_transfers([r for r in runs if r[2] >= args.window[0]], args.steps)
    return out


def _timed_allreduce(runs: list):
    """``--bucket-times``: a DDP comm hook that does what DDP's default does (the bucket divided by the world size,
    then summed by an asynchronous allreduce) and appends (``ddp bucket I``, its gradients, start, end) to ``runs``:
    from the hook's call to the allreduce's completion (its future's callback), in time.time() seconds, which Horovod's
    timeline summary reads as transfers (:func:`hvdtrain.timeline.summarize_transfers`)."""
    import torch.distributed as dist

    def hook(state, bucket):
        start, tensor = time.time(), bucket.buffer()
        tensor.div_(dist.get_world_size())
        name, count = f"ddp bucket {bucket.index()}", len(bucket.gradients())

        def done(future):
            runs.append((name, count, start, time.time()))
            return future.value()[0]
        return dist.all_reduce(tensor, async_op=True).get_future().then(done)
    return hook


def loader(args) -> dict:
    from .. import registry
    from ..config import parse_overrides
    cls = registry.load(args.recipe)
    cfg = parse_overrides(cls.config_class, [*args.recipe_args, "--resume", "never", "--output-dir",
                                             os.path.join(os.path.dirname(os.path.abspath(args.result)), "loader")])
    trainer = cls(cfg)
    trainer.setup()
    backend = trainer.backend
    trainer.train_sampler.set_epoch(0, 0)
    batches = backend.loader(trainer.train_set, trainer.train_sampler, cfg.batch_size, drop_last=True,
                             num_workers=cfg.num_workers)
    steps = min(args.steps, trainer.steps)
    next(batches)  # worker start-up is not the steady state
    start = time.perf_counter()
    for _ in range(steps - 1):
        x, _y = next(batches)
    backend.scalar(x.sum())  # the last batch is really there (MXNet's engine is asynchronous)
    seconds = time.perf_counter() - start
    backend.shutdown()
    return {"rank": 0, "size": 1, "seconds": seconds, "images": (steps - 1) * cfg.batch_size,
            "num_workers": cfg.num_workers, "framework": cfg.framework, "batch_size": cfg.batch_size}


LOOPS = {"horovod-torch": horovod_torch, "horovod-mxnet": horovod_mxnet, "ddp-torch": ddp_torch, "ps-mxnet": ps_mxnet,
         "single-mxnet": single_mxnet, "loader": loader}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m hvdtrain.bench.loops")
    parser.add_argument("loop", choices=sorted(LOOPS))
    parser.add_argument("--recipe", default="mnist")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60, help="timed steps")
    parser.add_argument("--warmup", type=int, default=0, help="untimed steps before them")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"], help="PyTorch loops")
    parser.add_argument("--result", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="ddp-torch: DDP's bucket size")
    parser.add_argument("--bucket-times", action="store_true",
                        help="ddp-torch: time each bucket's allreduce (a comm hook that does DDP's default); rank 0's "
                             "result then holds their summary as Horovod's timeline summary has it, under timeline")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # the recipe's own options come after --
    args = parser.parse_args(argv[:cut])
    args.recipe_args = argv[cut + 1:]
    args.cpu_seconds, args.thread_cpu, args.phase_seconds = None, ThreadCpu(), None
    out = LOOPS[args.loop](args)
    if args.cpu_seconds is not None:
        with open(f"{args.result}.rank{out['rank']}", "w") as f:
            json.dump({"rank": out["rank"], "cpu_seconds_per_step": args.cpu_seconds / args.steps,
                       "thread_cpu_per_step": dict(zip(ROLES, per_step(args.threads, args.steps))),
                       "thread_wakeups_per_step": {k: v / args.steps for k, v in args.thread_cpu.wakeups.items()},
                       "phase_seconds_per_step": {k: v / args.steps for k, v in (args.phase_seconds or {}).items()},
                       "timed_window": args.window}, f)
    if out["rank"] == 0:
        images = out.get("images", args.steps * args.batch_size * out["size"])
        out.update(loop=args.loop, recipe=args.recipe, batch_size=out.get("batch_size", args.batch_size),
                   steps=args.steps,
                   threads=args.threads, images_per_sec=images / out["seconds"])
        with open(args.result, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
