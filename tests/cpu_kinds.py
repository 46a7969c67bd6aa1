"""The CPU kinds that tests run the product's CPU-kind decisions under (see the cpu_kind fixture)."""

# The x86 kinds whose decisions differ (bf16 autocast, bf16 serving, INT8 targets), as /proc/cpuinfo names their
# flags. Tests of a decision run under each through CAPSNET_CPU_FLAGS, whatever this host is.
CPU_KINDS = {
    "avx2": "avx2 fma",  # AMD EPYC Rome/Milan: no AVX-512, no VNNI, no native bf16
    "avx512": "avx2 fma avx512f avx512_vnni",  # Intel Xeon Cascade Lake/Ice Lake: VNNI, no native bf16
    "avx512-bf16": "avx2 fma avx512f avx512_vnni avx512_bf16",  # AMD EPYC Zen 4
    "amx": "avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_int8",  # Intel Xeon Sapphire Rapids
}
