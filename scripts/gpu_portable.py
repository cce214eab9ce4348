"""GPU check of the batched portable path: bits vs the CPU loop, and step times on CUDA."""
import os, sys, time, statistics
os.environ["TETRAREC_KERNELS"] = "reference"  # the CPU side: the per-table loop
import torch
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
torch.use_deterministic_algorithms(True)
from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import reference, reference_batched
from tetrarec.kernels.tbe import FusedEmbeddingBagCollection
from tetrarec.types import OptimizerKind, PoolingMode, Precision
print("torch", torch.__version__, torch.cuda.get_device_name(0), flush=True)

def tables(prec, mean):
    pool = PoolingMode.MEAN if mean else PoolingMode.SUM
    return [TableConfig(name="a", num_embeddings=400, dim=8, precision=prec, feature_names=("fa", "fa2"), pooling=pool),
            TableConfig(name="b", num_embeddings=250, dim=5, precision=prec),
            TableConfig(name="c", num_embeddings=120, dim=8, precision=Precision.FP32),
            TableConfig(name="d", num_embeddings=300, dim=3, precision=prec, pooling=pool)]

def batch(ebc, b, seed):
    g = torch.Generator().manual_seed(seed)
    f = len(ebc.feature_names)
    lengths = torch.randint(0, 6, (f * b,), generator=g); lengths[::7] = 0
    rows = [t.num_embeddings for t in ebc.tables for _ in t.feature_names]
    values = torch.cat([torch.randint(0, r // 3 + 1, (int(n),), generator=g) for r, n in zip(rows, lengths.view(f, b).sum(1))])
    return values, lengths

def run(dev, kind, prec, mean, weighted, stoch):
    spec = SparseOptimizerSpec(kind=kind, lr=0.07, weight_decay=0.01)
    ebc = FusedEmbeddingBagCollection(tables(prec, mean), spec, seed=5, stochastic_rounding=stoch, device=dev)
    got = []
    for step in range(3):
        v, l = batch(ebc, 64, step)
        psw = torch.rand(v.numel(), generator=torch.Generator().manual_seed(9)) if weighted else None
        v, l = v.to(dev), l.to(dev); psw = psw.to(dev) if psw is not None else None
        out = ebc.pool_ids(v, l, psw)
        grad = torch.sin(torch.arange(out.numel(), device=dev).float()).view_as(out) * (1 + out)
        g = ebc.update_ids(grad, v, l, psw, want_psw=weighted)
        got += [out, *(s.clone() for s in ebc.storages()), g if g is not None else out[:0]]
    return [x.cpu() for x in got]

REAL = (reference_batched.pooled_forward, reference_batched.backward_update)
for MODE in ("cpu", "cudaloop"):
  bad = 0; n = 0
  for kind in OptimizerKind:
      for prec in (Precision.FP32, Precision.FP16, Precision.BF16, Precision.INT8, Precision.INT4):
          for mean, weighted, stoch in ((True, False, True), (False, True, False)):
              want = run("cpu", kind, prec, mean, weighted, stoch) if MODE == "cpu" else None
              got = run("cuda", kind, prec, mean, weighted, stoch)
              if MODE == "cudaloop":
                  reference_batched.pooled_forward, reference_batched.backward_update = reference.pooled_forward, reference.backward_update
                  want = run("cuda", kind, prec, mean, weighted, stoch)
                  reference_batched.pooled_forward, reference_batched.backward_update = REAL
              same = all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)) if a.numel() else a.shape == b.shape for a, b in zip(got, want))
              n += 1
              if not same:
                  bad += 1
                  diffs = [(i, (a.float() - b.float()).abs().max().item()) for i, (a, b) in enumerate(zip(got, want)) if a.numel() and not torch.equal(a, b)]
                  print("DIFF", MODE, kind.value, prec.value, mean, weighted, stoch, diffs[:2], flush=True)
  print(f"bitwise deterministic CUDA batched vs {MODE} loop: {n - bad}/{n} cases equal", flush=True)

def time_step(shape, impl_name, rounds=7):
    T, E, D, B, lo, hi = shape
    tabs = [TableConfig(name=f"t{i}", num_embeddings=E, dim=D) for i in range(T)]
    ebc = FusedEmbeddingBagCollection(tabs, SparseOptimizerSpec(kind=OptimizerKind.ADAGRAD, lr=0.01), seed=0, device="cuda")
    g = torch.Generator().manual_seed(0)
    l = torch.randint(lo, hi + 1, (T * B,), generator=g)
    v = torch.randint(0, E, (int(l.sum()),), generator=g)
    v, l = v.cuda(), l.cuda()
    ts = []
    for r in range(rounds + 2):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        out = ebc.pool_ids(v, l, None); ebc.update_ids(out, v, l, None)
        torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts[2:])

real = (reference_batched.pooled_forward, reference_batched.backward_update)
for name, shape in (("W 26x100k x64 B2048 L20", (26, 100_000, 64, 2048, 20, 20)), ("200x10k x16 B2048 L1-5", (200, 10_000, 16, 2048, 1, 5))):
    res = {}
    for impl in ("batched", "loop", "batched2"):
        if impl == "loop":
            reference_batched.pooled_forward, reference_batched.backward_update = reference.pooled_forward, reference.backward_update
        else:
            reference_batched.pooled_forward, reference_batched.backward_update = real
        res[impl] = time_step(shape, impl)
    print(f"CUDA step {name}: batched {res['batched']:.2f} / {res['batched2']:.2f} ms, loop {res['loop']:.2f} ms, loop/batched {res['loop']/min(res['batched'], res['batched2']):.1f}x", flush=True)
