"""``bf16_matmul = auto``: native BF16 only on CPUs with BF16 instructions.

The CPU's flags are passed in as text shaped like ``/proc/cpuinfo``, so every CPU kind
is tested on any machine, without patching anything.
"""

from __future__ import annotations

import pytest

from tetrarec.models.precision import cpu_flags, has_native_bf16, parse_cpu_flags

_X86 = "processor\t: {n}\nvendor_id\t: {vendor}\nmodel name\t: {model}\nflags\t\t: {flags}\n\n"
_BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma"


def _cpuinfo(model: str, flags: str, *, vendor: str = "GenuineIntel", cores: int = 2) -> str:
    return "".join(
        _X86.format(n=n, vendor=vendor, model=model, flags=f"{_BASE} {flags}") for n in range(cores)
    )


# (what, /proc/cpuinfo text, BF16 products native?)
CPUS = [
    ("AVX2 only (this project's 2-core machines)", _cpuinfo("AMD EPYC", "avx2"), False),
    # The bug this guards: oneDNN reports BF16 support on any AVX-512 CPU (it emulates
    # BF16 there on FP32 units); auto then picked native, ~8x slower than the emulation.
    (
        "AVX-512 without BF16 (Skylake-SP)",
        _cpuinfo("Intel Xeon Gold 6148", "avx2 avx512f avx512bw avx512vl avx512_vnni"),
        False,
    ),
    (
        "AVX-512 BF16 (Zen 4)",
        _cpuinfo("AMD EPYC 9R14", "avx2 avx512f avx512bw avx512_bf16", vendor="AuthenticAMD"),
        True,
    ),
    (
        "AMX BF16 (Sapphire Rapids)",
        _cpuinfo("Intel Xeon Platinum 8480", "avx2 avx512f amx_tile amx_bf16 amx_int8"),
        True,
    ),
    ("Arm with BF16 (Neoverse V1)", "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n", True),
    (
        "Arm without BF16 (Neoverse N1)",
        "processor\t: 0\nFeatures\t: fp asimd crc32 atomics\n",
        False,
    ),
]


@pytest.mark.parametrize(("what", "cpuinfo", "native"), CPUS, ids=[c[0] for c in CPUS])
def test_auto_is_native_only_with_bf16_instructions(what: str, cpuinfo: str, native: bool) -> None:
    """Fails if auto takes AVX-512 alone (or oneDNN's report) for BF16 units, or misses AMX."""
    assert has_native_bf16("cpu", cpuinfo) is native, what
    assert has_native_bf16("cpu", parse_cpu_flags(cpuinfo)) is native, what


def test_only_flag_lines_count() -> None:
    """Fails if a flag name elsewhere in the file (a model name) is taken for a flag."""
    text = "model name\t: Imaginary avx512_bf16 amx_bf16 Edition\nflags\t\t: fpu avx2\n"
    assert parse_cpu_flags(text) == {"fpu", "avx2"}
    assert has_native_bf16("cpu", text) is False


def test_flags_of_all_processors_are_united() -> None:
    """Fails if only the first processor's flags are read."""
    text = _cpuinfo("a", "avx2", cores=1) + "processor\t: 1\nflags\t\t: avx512_bf16\n"
    assert has_native_bf16("cpu", text) is True


def test_this_machines_flags_are_read_once() -> None:
    """Fails if the flags are re-read (a file read per training step) or parsed wrongly."""
    first = cpu_flags()
    assert cpu_flags() is first  # the cached object, not a new read
    if first is None:
        pytest.skip("no /proc/cpuinfo on this machine")
    with open("/proc/cpuinfo") as f:
        assert first == parse_cpu_flags(f.read())
    assert has_native_bf16("cpu") is ("avx512_bf16" in first or "amx_bf16" in first)
