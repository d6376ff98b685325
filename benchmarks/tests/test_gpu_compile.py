"""benchmarks/gpu_compile.py: its reading of a compiled program's kernels against a hand-written program, the
abstract generator it compiles against the concrete one, and its refusals. (Compiling for a GPU needs JAX's
CUDA plugin, which CI does not install.)"""
import jax
import jax.numpy as jnp
import pytest

from benchmarks import gpu_compile
from benchmarks.profile_decode import loop_body_kernels

HLO = """HloModule m

%fused (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %n = f32[2]{0} negate(%p)
}

%body (t: (s32[], f32[2])) -> (s32[], f32[2]) {
  %t = (s32[], f32[2]{0}) parameter(0)
  %x = f32[2]{0} get-tuple-element(%t), index=1
  %f1 = f32[2]{0} fusion(%x), kind=kLoop, calls=%fused
  %input_transpose_fusion.3 = f8e4m3fn[2]{0} fusion(%f1), kind=kInput, calls=%fused
  %d = f32[2]{0} custom-call(%f1), custom_call_target="__cublas$lt$matmul$f8"
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[2]{0}) tuple(%i, %d)
}

%cond (t: (s32[], f32[2])) -> pred[] {
  %t = (s32[], f32[2]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: f32[2]) -> f32[2] {
  %a = f32[2]{0} parameter(0)
  %pre = f32[2]{0} fusion(%a), kind=kInput, calls=%fused
  %z = s32[] constant(0)
  %t = (s32[], f32[2]{0}) tuple(%z, %pre)
  %w = (s32[], f32[2]{0}) while(%t), condition=%cond, body=%body
  ROOT %o = f32[2]{0} get-tuple-element(%w), index=1
}
"""


def test_kernels_counts_a_pass_of_the_program_and_of_its_loop_body():
    whole = gpu_compile.kernels(HLO)
    assert whole == {"kernels": 4, "by_kind": {"kInput": 2, "kLoop": 1, "__cublas$lt$matmul$f8": 1},
                     "transposes": {"f8e4m3fn[2]": 1}}
    body = gpu_compile.kernels(HLO, loop_body_only=True)
    assert body["kernels"] == 3 == sum(loop_body_kernels(HLO).values())


def test_an_abstract_generator_compiles_the_concrete_ones_decode(tmp_path):
    """Parameters as jax.ShapeDtypeStructs (what gpu_compile passes): nothing runs, and decode's compiled
    program has the concrete generator's kernels."""
    from jax3d.config import ModelConfig
    from jax3d.inference import Generator
    from jax3d.models import build_model
    from jax3d.parallel.mesh import MeshConfig

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=64)
    params = build_model(cfg).init(jax.random.key(0))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    mesh = MeshConfig(1, 1, 1).build(jax.devices()[:1])
    rows = [[3, 4, 5]] * 2
    hlos = [Generator(cfg, p, mesh, batch=2, max_len=32, dtype=jnp.float32).decode_hlo(rows) for p in (params, abstract)]
    concrete, from_shapes = (gpu_compile.kernels(h, loop_body_only=True) for h in hlos)
    assert from_shapes == concrete and concrete["kernels"] > 2 * 5
    gen = Generator(cfg, abstract, mesh, batch=2, max_len=32, dtype=jnp.float32)
    assert isinstance(gen.params["blocks"][0]["attn"]["qkv_kernel"], jax.ShapeDtypeStruct)
    # options given reach the compiler beside decode's own (gpu_compile decode --opt)
    with pytest.raises(Exception, match="xla_no_such_option"):
        gen.decode_hlo(rows, compiler_options={"xla_no_such_option": True})


def test_decode_refuses_a_kernel_it_does_not_know_in_one_sentence(tmp_path, capsys):
    target = tmp_path / "gpu.txtpb"
    target.write_text("")
    with pytest.raises(SystemExit) as e:
        gpu_compile.main(["--target-config", str(target), "decode", "--off", "fused_nrom"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "--off fused_nrom is no kernel" in err and "fused_norm" in err


@pytest.mark.parametrize("exists", [False, True])
def test_a_missing_target_or_plugin_is_one_sentence_and_exit_2(tmp_path, capsys, exists):
    target = tmp_path / "gpu.txtpb"
    if exists:
        target.write_text("not a target description")
    code = None
    try:
        code = gpu_compile.main(["--target-config", str(target), "decode"])
    except SystemExit as e:  # argparse's refusal
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and ("--target-config" in err or "GpuTargetConfigProto" in err)
    assert "Traceback" not in err


def test_a_long_tuple_type_does_not_hide_its_operation():
    """HLO writes /*index=5*/ into tuple types of six or more elements; the while loop and the fusion behind
    such types still count."""
    hlo = HLO.replace("%w = (s32[], f32[2]{0}) while(", "%w = (s32[], f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, "
                      "/*index=5*/f32[2]{0}) while(")
    assert gpu_compile.kernels(hlo) == gpu_compile.kernels(HLO)
