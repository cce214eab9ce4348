"""The device cache (issue 11): FP32 slots in device memory, backing rows in host memory.

The GPU cases (``gpu`` marker, skipped without CUDA) train the device cache against the
CPU cache: the policy runs on the same host tensors, so the counters, the cached rows
and the eviction order are identical; the rows agree within float error. Tolerance:
the FP32 outputs and slots ``rtol=1e-4, atol=1e-5`` (the portable kernels on CUDA add a
bag's rows in another order than the CPU's); the stored rows (FP16, INT8) the same but
for stochastic-rounding flips: the same random bits on both devices, but an FP32 value
within float error of a rounding boundary may round the other way (under 2% of the
values, as ``tests/unit/kernels/test_kernels_tbe.py`` allows the uncached collection).

The one-rank group case also runs on gloo on the CPU (a sharded cached group built
through ``group.py``'s device plumbing); it caches FP32 rows, which no rounding flip
separates, so the sharded tolerance (``rtol=1e-4, atol=1e-5`` on CUDA) holds.
"""

from __future__ import annotations

import pytest
import torch

from tetrarec.cache import CachedEmbeddingBagCollection, CacheSpec, count_ids
from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.sharding import LookupOptions, ShardedEmbeddingBagCollection, ShardingEnv
from tetrarec.sharding.state_dict import local_blocks
from tetrarec.sparse import SparseFeatures
from tetrarec.testing.equivalence import EquivalenceCase, compare, global_batch, reference_run
from tetrarec.testing.one_rank import one_rank_group

GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
ADAGRAD = SparseOptimizerSpec(kind="rowwise_adagrad", lr=0.2, initial_accumulator=0.1)


def tables(precision):
    return [
        TableConfig(
            name="a", num_embeddings=40, dim=8, feature_names=("f0", "f1"), precision=precision
        ),
        TableConfig(name="b", num_embeddings=24, dim=4, precision=precision, pooling="mean"),
        TableConfig(name="c", num_embeddings=12, dim=4, precision=precision),
    ]


def batch(seed, tabs):
    gen = torch.Generator().manual_seed(seed)
    bags = {}
    for t in tabs:
        for f in t.feature_names:
            lens = torch.randint(0, 6, (8,), generator=gen).tolist()
            bags[f] = [
                (torch.rand(n, generator=gen) ** 2 * t.num_embeddings).long().tolist() for n in lens
            ]
    return SparseFeatures.from_lists(bags)


def close_but_for_rounding_flips(got, want, what):
    flips = ((got - want).abs() > 1e-4 + 1e-4 * want.abs()).float().mean()
    assert flips < 0.02, f"{what}: {flips:.1%} of the values differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp16", "int8"])
@pytest.mark.parametrize("policy", ["lru", "lfu", "static"])
def test_device_cache_trains_as_the_cpu_cache(tmp_path, policy, precision):
    """3 steps: the same counters and cached rows, rows within float error.

    Catches: slots, ids or gradients left on the wrong device (a device error), a
    staged admission into the wrong slots or a lost write-back (rows far off), a policy
    that sees other ids than the CPU cache's (counters differ), a ``host`` table not
    kept on the device.
    """
    tabs = tables(precision)
    counts = count_ids([batch(s, tabs) for s in range(3)], tabs)
    kwargs = {
        "placements": {"a": "cached", "b": "ssd", "c": "host"},
        "static_counts": counts if policy == "static" else None,
        "seed": 3,
    }
    spec = CacheSpec(policy=policy, fraction=0.2, directory=str(tmp_path))
    cpu = CachedEmbeddingBagCollection(tabs, ADAGRAD, spec, **kwargs)
    kwargs["placements"] = {"a": "cached", "b": "ssd", "c": "device"}
    gpu = CachedEmbeddingBagCollection(tabs, ADAGRAD, spec, device="cuda", **kwargs)
    assert gpu._parts[0].module.storages()[0].device.type == "cuda"  # the slots
    assert {p.device.type for p in gpu._parts} == {"cuda", "cpu"}
    assert gpu.memory().device_bytes > 0
    for s in range(3):
        sf = batch(s, tabs)
        out_cpu = cpu(sf).values
        out_gpu = gpu(sf.to("cuda")).values
        assert out_gpu.device.type == "cuda"
        close_but_for_rounding_flips(out_gpu.detach().cpu(), out_cpu.detach(), f"output {s}")
        grad = torch.randn(out_cpu.shape, generator=torch.Generator().manual_seed(s))
        out_cpu.backward(grad)
        out_gpu.backward(grad.cuda())
    assert gpu.cache_stats() == cpu.cache_stats()
    for name, rows in cpu.cached_rows().items():
        assert torch.equal(gpu.cached_rows()[name], rows), name
    if policy != "static":
        assert sum(s.write_backs for s in gpu.cache_stats().values()) > 0
    for name, w in cpu.table_weights().items():
        close_but_for_rounding_flips(gpu.table_weights()[name].cpu(), w, name)
    saved_cpu, saved_gpu = cpu.state_dict(), gpu.state_dict()
    for key, value in saved_cpu.items():
        if key.endswith((".rows", ".slot_rows", ".dirty", ".last_used", ".freq", ".counters")):
            got = saved_gpu[key].cpu()
            if key.endswith(".rows"):  # FP32 slots (re-admitted rows: rounding flips)
                close_but_for_rounding_flips(got, value, key)
            else:
                assert torch.equal(got, value), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_run_builds_the_device_cache():
    """``build_embeddings`` on CUDA: the slots on the device, ``host`` tables kept there.

    Catches: the trainer still refusing (or silently building a CPU cache for) a GPU run
    with cached tables.
    """
    from tetrarec.config import RunConfig
    from tetrarec.config.tables import build_tables
    from tetrarec.train.build import build_embeddings

    config = RunConfig().with_overrides(
        [
            "model.num_sparse=2",
            "model.num_embeddings=50",
            "model.placement=[cached, host]",
            "model.cache.fraction=0.2",
            "model.precision=int8",
        ]
    )
    module = build_embeddings(config, build_tables(config.model), device=torch.device("cuda"))
    assert isinstance(module, CachedEmbeddingBagCollection)
    assert module.device.type == "cuda"
    assert [p.value for p in module.placements] == ["cached", "device"]


@pytest.mark.parametrize(
    "backend_device",
    [
        pytest.param(("gloo", "cpu"), id="gloo-cpu"),
        pytest.param(("nccl", "cuda"), marks=GPU, id="nccl-cuda"),
    ],
)
def test_cached_shards_on_a_one_rank_group_match_one_process(tmp_path, backend_device):
    """Table-wise and data-parallel cached shards, 2 steps, against the one-process cache.

    Catches: ``_check_placements`` refusing cached shards on a GPU rank, ``group.py``
    building the cached local module off the env's device, cache counters of a sharded
    run that differ from one process's.
    """
    backend, device = backend_device
    bad: list[str] = []
    with one_rank_group(tmp_path, backend, device) as comm:
        for types in (("table_wise",), ("data_parallel",)):
            case = EquivalenceCase(
                name="/".join(types),
                # FP32 rows: no rounding flip between devices, so the equivalence
                # tolerance holds (the mixed-precision rows are the test above)
                tables=tuple(tables("fp32")),
                types=types,
                optimizer=ADAGRAD,
                weighted=False,
                steps=2,
                placement="cached",
                cache_fraction=0.25,
            )
            env = ShardingEnv(comm, 1, comm.device)
            options = LookupOptions(
                optimizer=case.optimizer, seed=case.seed, cache=CacheSpec(fraction=0.25)
            )
            module = ShardedEmbeddingBagCollection(
                case.tables, case.sharding_plan(1, 1), env, options
            )
            outputs = []
            for step in range(case.steps):
                bags, weights, grad = global_batch(case, step)
                sf = SparseFeatures.from_lists(bags, weights=weights).to(comm.device)
                out = module(sf).values
                assert out.device == comm.device
                outputs.append(out.detach().cpu())
                torch.autograd.backward(out, grad.to(comm.device))
            with torch.no_grad():
                bags, weights, _ = global_batch(case, case.steps)
                sf = SparseFeatures.from_lists(bags, weights=weights).to(comm.device)
                outputs.append(module(sf).values.cpu())
            got = {
                "outputs": outputs,
                "weight_grads": [],
                **local_blocks(module),
                "cache_stats": module.cache_stats(),
            }
            assert got["cache_stats"], types  # the shards are cached
            rtol, atol = (1e-6, 1e-7) if device == "cpu" else (1e-4, 1e-5)
            bad += compare(case, [got], reference_run(case), rtol=rtol, atol=atol)
    assert not bad, "\n".join(bad)
