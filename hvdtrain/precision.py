"""Which precision a run computes in: ``--precision auto`` resolved from what the hardware does natively.

- a GPU: fp16 with dynamic loss scaling (tensor cores; the mission's ImageNet recipe);
- a CPU with native bf16 instructions, AVX512-BF16 or AMX-BF16 (the ``avx512_bf16`` / ``amx_bf16`` flags of the
  ``flags`` line in /proc/cpuinfo): bf16, where the framework's bf16 is faster than its fp32 there (PyTorch; not
  MXNet 1.9.1, whose AMP bf16 measured slower than fp32 even with AMX: the backend says so);
- any other CPU: fp32. There bf16 is emulated: MXNet's oneDNN (1.9.1) has no bf16 convolution at all without AVX-512
  and fails at the first forward pass ("could not create a primitive descriptor iterator"); PyTorch's bf16 runs, but
  a matmul took 30x its fp32 time on an AVX2-only processor.

oneDNN, under both frameworks, can be told to use fewer instructions than the processor has (``DNNL_MAX_CPU_ISA``,
``ONEDNN_MAX_CPU_ISA``, e.g. ``AVX2``); a cap below ``AVX512_CORE_BF16`` makes bf16 emulated however capable the
processor, and is read here too. That is also how the tests run the no-bf16 paths on a processor that has bf16.

``HVDTRAIN_AUTO_PRECISION=bf16|fp32`` forces what auto decides on a CPU, as a processor with native bf16 (bf16, or
fp32 where the framework's bf16 is slower) or one without it (fp32) would: the test suite runs the tests that compare
figures under both outcomes on any machine (``make test``), and a user can pin auto's outcome for a whole cluster.
Explicit ``--precision`` values and GPUs are not affected.

Pure functions: the backends decide what the framework can do (a GPU, the refusal); nothing here imports one.
"""
from __future__ import annotations

import os
from typing import FrozenSet, Mapping, Optional, Sequence, Tuple

CPUINFO = "/proc/cpuinfo"
CPUINFO_VARIABLE = "HVDTRAIN_CPUINFO"
"""Environment variable: a file read in place of /proc/cpuinfo (tests give one rank another processor's flags)."""
PRECISIONS = ("fp32", "bf16", "fp16")
"""Every precision a run computes in (--precision without auto)."""
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")
"""CPU flags (Linux names) of instructions that compute in bf16 natively: AVX512-BF16 and AMX-BF16."""
AVX512_CORE = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
"""What oneDNN calls AVX512_CORE: below it, MXNet 1.9.1's oneDNN has no bf16 convolution."""
ISA_CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
AUTO_VARIABLE = "HVDTRAIN_AUTO_PRECISION"
"""Environment variable: bf16 or fp32, what --precision auto decides on a CPU whatever the processor has."""
AUTO_OUTCOMES = ("bf16", "fp32")

# oneDNN's ISA names in increasing order (its documented values of DNNL_MAX_CPU_ISA), and the least of them that
# runs each native bf16 instruction set.
_ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16")
_NEEDS_ISA = {"avx512_bf16": "AVX512_CORE_BF16", "amx_bf16": "AVX512_CORE_AMX"}


def read_cpu_flags(path: str = "") -> FrozenSet[str]:
    """The first processor's ``flags`` from ``path``, else $HVDTRAIN_CPUINFO, else /proc/cpuinfo (empty where there
    is no such file: not Linux)."""
    path = path or os.environ.get(CPUINFO_VARIABLE) or CPUINFO
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def isa_cap(environ: Mapping[str, str] = os.environ) -> Optional[Tuple[str, str]]:
    """(variable, value) of a oneDNN ISA cap in the environment, or None. ``ALL`` / ``DEFAULT`` cap nothing."""
    for var in ISA_CAP_VARIABLES:
        value = environ.get(var, "").strip().upper()
        if value and value not in ("ALL", "DEFAULT"):
            return var, value
    return None


def _allowed(flag: str, cap: Optional[Tuple[str, str]]) -> bool:
    if cap is None:
        return True
    value = cap[1]
    if value not in _ONEDNN_ISAS:  # a name this list does not know (a newer oneDNN's): trust the processor
        return True
    return _ONEDNN_ISAS.index(value) >= _ONEDNN_ISAS.index(_NEEDS_ISA[flag])


def native_bf16(flags: FrozenSet[str], cap: Optional[Tuple[str, str]] = None) -> Tuple[str, ...]:
    """The native bf16 instruction sets of this CPU that oneDNN may use (an empty tuple: bf16 is emulated)."""
    return tuple(f for f in NATIVE_BF16 if f in flags and _allowed(f, cap))


def missing_bf16(flags: FrozenSet[str], cap: Optional[Tuple[str, str]] = None) -> str:
    """Why this CPU has no native bf16, in words naming the missing feature (for messages)."""
    present = [f for f in NATIVE_BF16 if f in flags]
    if present and cap is not None:
        return f"{cap[0]}={cap[1]} keeps oneDNN from using {' and '.join(present)}"
    if not flags:
        return f"no CPU flags could be read ({CPUINFO})"
    why = f"the CPU has neither {' nor '.join(NATIVE_BF16)} ({CPUINFO})"
    lacking = [f for f in AVX512_CORE if f not in flags]
    if lacking:
        why += f" and no AVX-512 ({lacking[0]} missing)"
    return why


def detect_cpu_bf16(environ: Mapping[str, str] = os.environ) -> Tuple[Tuple[str, ...], str]:
    """(:func:`native_bf16`, :func:`missing_bf16`) of this machine's CPU under this environment's oneDNN cap."""
    flags, cap = read_cpu_flags(), isa_cap(environ)
    return native_bf16(flags, cap), missing_bf16(flags, cap)


def forced_auto(environ: Mapping[str, str] = os.environ) -> str:
    """$HVDTRAIN_AUTO_PRECISION: "bf16", "fp32", or "" when unset. Raises ValueError, naming the variable, for any
    other value."""
    value = environ.get(AUTO_VARIABLE, "").strip().lower()
    if value and value not in AUTO_OUTCOMES:
        raise ValueError(f"{AUTO_VARIABLE}={environ[AUTO_VARIABLE]!r} is not one of {', '.join(AUTO_OUTCOMES)} "
                         f"(what --precision auto decides on a CPU): set one of them or unset it")
    return value


def choose(requested: str, on_gpu: bool, native: Sequence[str], missing: str = "",
           adasum: bool = False, slower_bf16: str = "", forced: str = "") -> Tuple[str, str]:
    """(precision, reason) for ``--precision requested``: auto resolved as the module docstring says.

    ``native``: :func:`native_bf16` of this CPU; ``missing``: :func:`missing_bf16`, said when bf16 is not chosen.
    With ``adasum`` auto never picks fp16 (Adasum and loss scaling exclude each other). ``slower_bf16``: why the
    framework's bf16 is slower than its fp32 on a CPU even with native bf16 (then auto keeps fp32 there).
    ``forced``: :func:`forced_auto`, which decides on a CPU in place of ``native``."""
    if requested != "auto":
        return requested, f"--precision {requested}"
    if on_gpu:
        if adasum:
            return "fp32", "auto: a GPU, fp32 because --adasum excludes fp16's loss scaling"
        return "fp16", "auto: a GPU, fp16 with dynamic loss scaling"
    if forced == "fp32":
        return "fp32", f"auto: {AUTO_VARIABLE}=fp32, as on a CPU without native bf16"
    if forced == "bf16":
        if slower_bf16:
            return "fp32", f"auto: {AUTO_VARIABLE}=bf16, as on a CPU with native bf16, but {slower_bf16}"
        return "bf16", f"auto: {AUTO_VARIABLE}=bf16, as on a CPU with native bf16"
    if native and slower_bf16:
        return "fp32", f"auto: the CPU has native bf16 ({', '.join(native)}), but {slower_bf16}"
    if native:
        return "bf16", f"auto: the CPU has native bf16 ({', '.join(native)} in {CPUINFO})"
    return "fp32", f"auto: no native bf16 on this CPU: {missing or 'bf16 would be emulated'}"


__all__ = ["read_cpu_flags", "isa_cap", "native_bf16", "missing_bf16", "detect_cpu_bf16", "forced_auto", "choose",
           "NATIVE_BF16", "AVX512_CORE", "PRECISIONS", "AUTO_VARIABLE"]
