"""benchmarks.fp8_probe runs on a CPU at toy sizes (`--small`), every variant under every flag set, so its one
GPU call can't die on a typo; and its reading of a compiled module's GEMMs tells cuBLASLt FP8 calls, Triton GEMM
fusions (with an f8 prologue or f8 operands) and plain cuBLAS calls apart, in GPU HLO as XLA prints it."""
import subprocess
import sys

from benchmarks import fp8_probe, harness

GPU_HLO = r"""HloModule jit_run, entry_computation_layout={(f8e4m3fn[16384,2048]{1,0}, f8e4m3fn[2048,8192]{1,0})->bf16[16384,8192]{1,0}}

%gemm_fusion_dot.1_computation (parameter_0: f8e4m3fn[16384,2048], parameter_1: bf16[], parameter_2: bf16[2048,8192]) -> bf16[16384,8192] {
  %parameter_0 = f8e4m3fn[16384,2048]{1,0} parameter(0)
  %convert.1 = bf16[16384,2048]{1,0} convert(%parameter_0)
  %parameter_1 = bf16[] parameter(1)
  %broadcast.1 = bf16[16384,2048]{1,0} broadcast(%parameter_1), dimensions={}
  %multiply.1 = bf16[16384,2048]{1,0} multiply(%convert.1, %broadcast.1)
  %parameter_2 = bf16[2048,8192]{1,0} parameter(2)
  ROOT %dot.1 = bf16[16384,8192]{1,0} dot(%multiply.1, %parameter_2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(run)/jit(main)/mlp/btd,df->btf/dot_general"}
}

%gemm_fusion_dot.2_computation (parameter_0: f8e4m3fn[16384,2048], parameter_1: f8e4m3fn[2048,8192]) -> bf16[16384,8192] {
  %parameter_0 = f8e4m3fn[16384,2048]{1,0} parameter(0)
  %parameter_1 = f8e4m3fn[2048,8192]{1,0} parameter(1)
  ROOT %dot.2 = bf16[16384,8192]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.9 (Arg_0.1: f8e4m3fn[16384,2048], Arg_1.2: f8e4m3fn[8192,2048], Arg_2.3: bf16[2048,8192], Arg_3.4: bf16[]) -> bf16[16384,8192] {
  %Arg_0.1 = f8e4m3fn[16384,2048]{1,0} parameter(0)
  %Arg_1.2 = f8e4m3fn[8192,2048]{1,0} parameter(1)
  %Arg_2.3 = bf16[2048,8192]{1,0} parameter(2)
  %Arg_3.4 = bf16[] parameter(3)
  %c = f32[] constant(1)
  %cublas-lt-matmul.1 = (bf16[16384,8192]{1,0}, s8[33554432]{0}) custom-call(%Arg_0.1, %Arg_1.2, %c, %c), custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(run)/jit(main)/mlp/transpose(jvp(btd,df->btf))/dot_general"}, backend_config={"gemm_backend_config":{"alpha_real":1}}
  %gemm_fusion_dot.1 = bf16[16384,8192]{1,0} fusion(%Arg_0.1, %Arg_3.4, %Arg_2.3), kind=kCustom, calls=%gemm_fusion_dot.1_computation, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"128"}}}
  %gemm_fusion_dot.2 = bf16[16384,8192]{1,0} fusion(%Arg_0.1, %Arg_0.1), kind=kCustom, calls=%gemm_fusion_dot.2_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %cublas-gemm.1 = (bf16[16384,8192]{1,0}, s8[4194304]{0}) custom-call(bf16[16384,2048]{1,0} %x, bf16[2048,8192]{1,0} %Arg_2.3), custom_call_target="__cublas$gemm"
  ROOT %t = bf16[16384,8192]{1,0} get-tuple-element(%cublas-lt-matmul.1), index=0
}
"""


def test_gemm_lowering_reads_gpu_hlo():
    found = fp8_probe.gemm_lowering(GPU_HLO)
    assert found == {
        "custom-call __cublas$lt$matmul$f8 [f8e4m3fn,f8e4m3fn->bf16]": 1,
        "__triton_gemm dot[bf16,bf16->bf16] f8-in-fusion": 1,  # fake quantization: a bf16 dot, f8 prologue
        "__triton_gemm dot[f8e4m3fn,f8e4m3fn->bf16]": 1,  # an FP8 GEMM in Triton
        "custom-call __cublas$gemm [bf16,bf16->bf16]": 1}
    assert harness.gemm_kinds(GPU_HLO) == found  # what throughput.py records for an FP8 run
    where = dict(fp8_probe.gemm_details(GPU_HLO))
    assert where["custom-call __cublas$lt$matmul$f8 [f8e4m3fn,f8e4m3fn->bf16]"] == "mlp/transpose(jvp(btd,df->btf))"
    assert where["__triton_gemm dot[bf16,bf16->bf16] f8-in-fusion"] == "mlp/btd,df->btf"


def test_small_probe_lists_every_variant_under_every_flag_set():
    out = subprocess.run([sys.executable, "-m", "benchmarks.fp8_probe", "--small", "--repeats", "1"],
                         env=harness.child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    table = text[text.index("flags  "):].splitlines()
    rows = {(line.split()[0], line.split()[1]): line for line in table[1:]}
    assert "no GPU present" in text
    for flags in fp8_probe.FLAG_SETS:
        for variant in fp8_probe.GEMM_VARIANTS:
            row = rows[(flags, variant)]
            assert "ERROR" not in row, row
    for variant in ("step-bf16", "step-fp8"):
        assert "ERROR" not in rows[("default", variant)]
    # jax3d's dots take the f8 arrays (forward e4m3 x e4m3, backward e5m2 against e4m3); its first pattern's take
    # dequantized bf16
    assert "f8E4M3FN,f8E4M3FN->bf16" in rows[("default", "jax3d")]
    assert "f8E4M3FN,f8E4M3FN->bf16" in rows[("default", "direct")]
    assert "f8E5M2,f8E4M3FN->bf16;f8E4M3FN,f8E5M2->bf16" in rows[("default", "jax3d-grad")]
    assert "bf16,bf16->bf16" in rows[("default", "dequantized-grad")]
    assert "# default step-fp8: each GEMM" in text


def test_the_dequantized_pattern_computes_what_jax3ds_fp8_einsum_does():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax3d.models import fp8

    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (2, 8, 32), jnp.float32)
    w = jax.random.normal(kw, (32, 16), jnp.float32) / 8
    g = jax.random.normal(kg, (2, 8, 16), jnp.float32)
    s = jnp.array([1 / 64, 1 / 512, 1 / 1024], jnp.float32)
    ref, ref_pull = jax.vjp(lambda x, w, s: fp8.einsum("btd,df->btf", x, w, s, "hybrid"), x, w, s)
    got, pull = jax.vjp(lambda x, w, s: fp8_probe.dequantized_einsum("hybrid", x, w, s), x, w, s)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(pull(g), ref_pull(g)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
