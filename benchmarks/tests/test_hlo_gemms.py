"""benchmarks.hlo_gemms' reading of a compiled module's GEMMs tells cuBLASLt FP8 calls, Triton GEMM fusions (with an
f8 prologue or f8 operands) and plain cuBLAS calls apart, in GPU HLO as XLA prints it."""
from benchmarks import harness, hlo_gemms

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
    found = hlo_gemms.gemm_lowering(GPU_HLO)
    assert found == {
        "custom-call __cublas$lt$matmul$f8 [f8e4m3fn,f8e4m3fn->bf16]": 1,
        "__triton_gemm dot[bf16,bf16->bf16] f8-in-fusion": 1,  # fake quantization: a bf16 dot, f8 prologue
        "__triton_gemm dot[f8e4m3fn,f8e4m3fn->bf16]": 1,  # an FP8 GEMM in Triton
        "custom-call __cublas$gemm [bf16,bf16->bf16]": 1}
    assert harness.gemm_kinds(GPU_HLO) == found  # what throughput.py records for an FP8 run
    where = dict(hlo_gemms.gemm_details(GPU_HLO))
    assert where["custom-call __cublas$lt$matmul$f8 [f8e4m3fn,f8e4m3fn->bf16]"] == "mlp/transpose(jvp(btd,df->btf))"
    assert where["__triton_gemm dot[bf16,bf16->bf16] f8-in-fusion"] == "mlp/btd,df->btf"
