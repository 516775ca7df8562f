"""--precision auto: what the CPU's flags (and a oneDNN ISA cap) make of it, and the words that say why."""
from hvdtrain import precision as p

# Flags as /proc/cpuinfo lists them on the three kinds of processor this project's machines come with.
AVX2_ONLY = frozenset("fpu sse4_2 avx avx2 fma".split())  # AMD EPYC family 25 model 1
AVX512_NO_BF16 = AVX2_ONLY | frozenset(p.AVX512_CORE)  # Skylake / Cascade Lake
SAPPHIRE = AVX512_NO_BF16 | {"avx512_bf16", "amx_bf16", "amx_tile"}


def test_flags_are_read_from_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert p.read_cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert p.read_cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_native_bf16_needs_avx512_bf16_or_amx():
    assert p.native_bf16(AVX2_ONLY) == ()
    assert p.native_bf16(AVX512_NO_BF16) == ()
    assert p.native_bf16(SAPPHIRE) == ("avx512_bf16", "amx_bf16")
    assert p.native_bf16(AVX512_NO_BF16 | {"avx512_bf16"}) == ("avx512_bf16",)


def test_a_onednn_cap_below_bf16_makes_bf16_emulated():
    assert p.isa_cap({"DNNL_MAX_CPU_ISA": "avx2"}) == ("DNNL_MAX_CPU_ISA", "AVX2")
    assert p.isa_cap({"ONEDNN_MAX_CPU_ISA": "ALL"}) is None and p.isa_cap({}) is None
    assert p.native_bf16(SAPPHIRE, ("DNNL_MAX_CPU_ISA", "AVX2")) == ()
    assert p.native_bf16(SAPPHIRE, ("DNNL_MAX_CPU_ISA", "AVX512_CORE_BF16")) == ("avx512_bf16",)
    assert p.native_bf16(SAPPHIRE, ("DNNL_MAX_CPU_ISA", "AVX512_CORE_AMX")) == ("avx512_bf16", "amx_bf16")
    assert p.native_bf16(SAPPHIRE, ("DNNL_MAX_CPU_ISA", "SOMETHING_NEWER")) == ("avx512_bf16", "amx_bf16")


def test_the_missing_feature_is_named():
    assert p.missing_bf16(AVX2_ONLY) == ("the CPU has neither avx512_bf16 nor amx_bf16 (/proc/cpuinfo) and no "
                                         "AVX-512 (avx512f missing)")
    assert p.missing_bf16(AVX512_NO_BF16) == "the CPU has neither avx512_bf16 nor amx_bf16 (/proc/cpuinfo)"
    assert p.missing_bf16(SAPPHIRE, ("DNNL_MAX_CPU_ISA", "AVX2")) == \
        "DNNL_MAX_CPU_ISA=AVX2 keeps oneDNN from using avx512_bf16 and amx_bf16"
    assert "no CPU flags could be read" in p.missing_bf16(frozenset())


def test_auto_picks_what_the_hardware_does_natively():
    assert p.choose("auto", True, ()) == ("fp16", "auto: a GPU, fp16 with dynamic loss scaling")
    assert p.choose("auto", False, ("amx_bf16",)) == ("bf16", "auto: the CPU has native bf16 (amx_bf16 in "
                                                              "/proc/cpuinfo)")
    precision, why = p.choose("auto", False, (), p.missing_bf16(AVX2_ONLY))
    assert precision == "fp32" and "neither avx512_bf16 nor amx_bf16" in why


def test_an_explicit_precision_is_kept_and_adasum_never_gets_fp16():
    for requested in ("fp32", "fp16", "bf16"):
        assert p.choose(requested, False, ()) == (requested, f"--precision {requested}")
    assert p.choose("auto", True, (), adasum=True)[0] == "fp32"


def test_auto_keeps_fp32_where_the_frameworks_bf16_is_slower():
    precision, why = p.choose("auto", False, ("amx_bf16",), slower_bf16="its bf16 is slower")
    assert precision == "fp32" and why == "auto: the CPU has native bf16 (amx_bf16), but its bf16 is slower"
    assert p.choose("bf16", False, ("amx_bf16",), slower_bf16="its bf16 is slower")[0] == "bf16"


def test_auto_can_be_forced_to_either_processors_outcome():
    """HVDTRAIN_AUTO_PRECISION: what auto decides on a CPU, as a processor with or without native bf16 would, on
    any machine (the suite runs its figure-comparing tests under both); explicit precisions and GPUs keep theirs."""
    assert p.forced_auto({}) == "" and p.forced_auto({p.AUTO_VARIABLE: " BF16 "}) == "bf16"
    assert p.choose("auto", False, (), forced="bf16") == ("bf16", "auto: HVDTRAIN_AUTO_PRECISION=bf16, as on a CPU "
                                                                 "with native bf16")
    assert p.choose("auto", False, ("amx_bf16",), forced="fp32")[0] == "fp32"
    assert p.choose("auto", False, (), slower_bf16="its bf16 is slower", forced="bf16")[0] == "fp32"
    assert p.choose("auto", True, (), forced="bf16")[0] == "fp16"
    assert p.choose("fp32", False, (), forced="bf16")[0] == "fp32"
    try:
        p.forced_auto({p.AUTO_VARIABLE: "fp16"})
    except ValueError as e:
        assert str(e).startswith("HVDTRAIN_AUTO_PRECISION='fp16' is not one of bf16, fp32"), e
    else:
        raise AssertionError("fp16 accepted")
