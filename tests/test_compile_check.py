"""launch/compile_check.py: the TPU compiler's per-chip memory of a run config's device functions (issue 27).

Runs the script as a subprocess (its own JAX set-up: libtpu from ``.libtpu/``, which ``make setup`` / ``make libtpu``
installs) on a 4-chip v5p topology with a two-layer model, and once with a shape that cannot fit.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "launch", "compile_check.py")
LIBTPU_DIR = os.path.join(REPO, ".libtpu")
FIELDS = (
    "bench",
    "function",
    "topology",
    "chips",
    "mesh",
    "shapes",
    "args_gib",
    "temp_gib",
    "out_gib",
    "peak_gib",
    "hbm_gib",
    "fits",
    "compile_s",
)
V5P_HBM_GIB = 95.74  # what the compiler reports for a v5p chip


def _module():
    spec = importlib.util.spec_from_file_location("compile_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("compile_check", mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)  # imports no JAX at module level
    return mod


def _need_libtpu():
    if importlib.util.find_spec("libtpu") is None and not os.path.isdir(os.path.join(LIBTPU_DIR, "libtpu")):
        pytest.fail("libtpu is not installed: run `make libtpu` (make setup installs it into .libtpu/)")


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return env


def _run(args, timeout=600):
    p = subprocess.run(
        [sys.executable, SCRIPT, *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    return p, lines


def _model_file(tmp_path_factory, name: str, **dims) -> str:
    """Qwen2.5-7B's config.json with ``dims`` replaced, written to a temporary file."""
    with open(os.path.join(REPO, "comprl_jax", "models", "presets", "qwen2.5-7b-instruct.json")) as f:
        d = json.load(f)
    d.update(dims)
    path = tmp_path_factory.mktemp("compile_check") / f"{name}.json"
    path.write_text(json.dumps(d))
    return str(path)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """Qwen2.5's config.json with two layers of width 64 (GQA 4 / 2 heads), vocabulary 512."""
    return _model_file(
        tmp_path_factory, "tiny", hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, max_window_layers=2, vocab_size=512,
    )  # fmt: skip


def _small(model):
    return [
        "--config=configs/minihack_room.py",
        "--topology=v5p:2x2x1",
        f"--model={model}",
        f"--extractor_model={model}",
    ]


@pytest.mark.slow
def test_four_functions_fit_on_a_v5p_2x2x1(tiny_model):
    _need_libtpu()
    p, lines = _run([*_small(tiny_model), "--seq_len=256", "--rows=4", "--micro_batches=2"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert [ln["function"] for ln in lines] == ["actor_update", "extractor_update", "prefill", "decode"]
    for ln in lines:
        missing = [k for k in FIELDS if k not in ln]
        assert not missing, (missing, ln)
        assert ln["bench"] == "compile_check" and ln["platform"] == "tpu" and ln["topology"] == "v5p:2x2x1"
        assert ln["chips"] == 4 and ln["device_kind"] == "TPU v5"
        if ln["function"].endswith("update"):
            assert ln["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}  # reproduce.py's data=1, fsdp=-1
        else:  # the sampler's decode layout: a small model is replicated on every chip, rows split 4 ways
            assert ln["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
        assert ln["hbm_gib"] == V5P_HBM_GIB
        assert ln["fits"] is True and "error" not in ln
        assert ln["dtype"] == "bfloat16" and ln["param_dtype"] == "float32"
        assert 0 < ln["peak_gib"] < 1 and ln["temp_gib"] >= 0 and ln["compile_s"] >= 0
    upd = {ln["function"]: ln for ln in lines}
    for f in ("actor_update", "extractor_update"):
        assert upd[f]["shapes"] == {"rows": 8, "micro_batch_rows": 4, "micro_batches": 2, "seq_len": 256}
        assert upd[f]["args_gib"] > 0  # float32 params + AdamW state, sharded over 4 chips
    assert upd["prefill"]["shapes"]["rows"] == 4 and upd["prefill"]["shapes"]["cache_len"] == 256
    assert upd["decode"]["shapes"]["max_new_tokens"] == 4096  # actor.sampling.max_new_tokens


@pytest.mark.slow
def test_attention_backend_reaches_the_compiled_update(tiny_model):
    """``--set=actor.attention=...`` reaches the compiled actor_update; ``auto`` is splash on a TPU topology."""
    _need_libtpu()
    base = [*_small(tiny_model), "--seq_len=256", "--rows=4", "--micro_batches=1", "--functions=actor_update"]
    got = {}
    for choice in ("xla", "splash", "auto"):
        p, lines = _run([*base, f"--set=actor.attention={choice}"])
        assert p.returncode == 0 and len(lines) == 1, p.stderr[-3000:]
        assert lines[0]["fits"] is True and "error" not in lines[0]
        got[choice] = lines[0]["attention"]
    assert got == {"xla": "xla", "splash": "splash", "auto": "auto -> splash"}


@pytest.fixture(scope="module")
def kv_model(tmp_path_factory):
    """Four layers with a TPU-shaped KV cache: 4 KV heads of 128 (a [.., 4, 128] tile, as Qwen2.5-7B's)."""
    return _model_file(
        tmp_path_factory, "kv", hidden_size=512, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=4, num_hidden_layers=4, max_window_layers=4, vocab_size=512,
    )  # fmt: skip


def test_decode_updates_the_cache_in_place(kv_model):
    """The decode loop's KV-cache writes must not copy the cache: the TPU compiler's temporaries stay within one
    layer's K and V (read by attention) plus the scores. The ``jax.vmap``-batched scatter transposed the whole
    ``[L, B, S, Hkv, Dh]`` cache into a temporary (temp 1.015 GiB here, = the cache; 7.2 GiB per chip for the
    paper's 7B decode)."""
    _need_libtpu()
    p, lines = _run([*_small(kv_model), "--functions=decode", "--rows=16", "--seq_len=32768"])
    assert p.returncode == 0, p.stderr[-3000:]
    (ln,) = lines
    rows_per_chip, layers, slots, kv_heads, head_dim = 16 // 4, 4, 32768, 4, 128
    cache = 2 * layers * rows_per_chip * slots * kv_heads * head_dim * 2 / 2**30  # K and V, bf16: 1 GiB
    one_layer = cache / layers  # 0.25 GiB: K and V of the layer being attended
    scores = rows_per_chip * 4 * 16 * slots * 4 / 2**30  # f32 [rows, heads, 16 inputs, S]: 8 MiB
    assert ln["out_gib"] == pytest.approx(cache, abs=0.01) and ln["alias_gib"] == pytest.approx(
        cache, abs=0.01
    )
    assert ln["temp_gib"] <= one_layer + scores + 1 / 32, ln  # measured 0.164 GiB (2026-12-03)


def test_decode_with_one_kv_head_per_chip_keeps_the_cache_layout(kv_model):
    """Tensor parallelism over all 4 KV heads (each chip holds one, as Qwen2.5-7B's 4 at ``rollout_tensor=4``):
    the decode loop must still update the cache in place. When the write's update window held every layer
    (``[L, Hkv, Dh]``), the TPU compiler gave the loop's cache the layout that window wants and copied the whole
    K and V into it and back (temp 1.35 GiB here against the 1 GiB cache; 16.7 GiB per chip for the paper's
    256-row decode on v5p-64). Each layer is now a batch dim of the scatter (``kv_cache.write``)."""
    _need_libtpu()
    args = ["--functions=decode", "--rows=16", "--seq_len=32768", "--set=actor.rollout_tensor=4"]
    p, lines = _run([*_small(kv_model), *args])
    assert p.returncode == 0, p.stderr[-3000:]
    (ln,) = lines
    assert ln["mesh"]["tensor"] == 4 and ln["mesh"]["data"] == 1
    rows_per_chip, layers, slots, kv_heads, head_dim = 16, 4, 32768, 1, 128
    cache = 2 * layers * rows_per_chip * slots * kv_heads * head_dim * 2 / 2**30  # K and V, bf16: 1 GiB
    one_layer = cache / layers
    scores = rows_per_chip * 1 * 16 * slots * 4 / 2**30  # f32 [rows, 1 query head, 16 inputs, S]: 32 MiB
    assert ln["out_gib"] == pytest.approx(cache, abs=0.01) and ln["alias_gib"] == pytest.approx(
        cache, abs=0.01
    )
    assert ln["temp_gib"] <= one_layer + scores + 1 / 32, ln


@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_paged_cache_writes_keep_the_pool_in_place(kv_model, tensor):
    """A paged cache (``actor.kv_cache=paged``; 16 rows of 32k positions, 4 KV heads) on v5p:2x2x1 at
    ``rollout_tensor`` 1 / 2 / 4 (4 / 2 / 1 KV heads per chip): the decode's temporaries are one layer's gathered
    window for its first 16-token step (the gather path: K and V and their row-major copy for attention), never
    the pool. Temp GiB at tensor 1 / 2 / 4, before: decode 0.76 / 2.01 / 2.01, prefill 3.13 / 2.50 / 1.78; now:
    decode 0.51 / 0.51 / 0.51, prefill 1.61 / 1.88 / 2.0 (the dense cache's prefill: 1.69 / 1.75 / 1.69). The kernel path's in-scan write viewed the pool
    as ``[L * Hkv * P, page, Dh]``, merging the split head axis (the TPU compiler all-gathered the whole pool for
    every layer of every step); the write after the layers had the layers in its update window, and the compiler
    relaid the pool out for it. Both scatter one ``[Dh]`` row per layer and head now (batch dims of the scatter),
    and a prefill gathers a layer's pages from the stacked pool (``kv_cache.gather_pages(layer=)``), not from a
    copy of its slice. The pool is replicated over the data axis (``args_gib`` = 4 / 2 / 1 GiB)."""
    _need_libtpu()
    args = [
        "--functions=decode,prefill", "--rows=16", "--seq_len=32768", "--prompt_len=8192",
        f"--set=actor.rollout_tensor={tensor}", "--set=actor.kv_cache=paged",
    ]  # fmt: skip
    p, lines = _run([*_small(kv_model), *args])
    assert p.returncode == 0, p.stderr[-3000:]
    dec, pre = lines
    assert dec["shapes"]["kv_cache"] == "paged" and dec["mesh"]["tensor"] == tensor, dec
    data = 4 // tensor
    rows_per_chip, layers, slots, kv_heads, head_dim = 16 // data, 4, 32768, 4 // tensor, 128
    window = (
        2 * rows_per_chip * slots * kv_heads * head_dim * 2 / 2**30
    )  # one layer's K and V, bf16: 0.25 GiB
    pool = 2 * layers * 16 * slots * kv_heads * head_dim * 2 / 2**30  # every row's pages on every data shard
    assert dec["out_gib"] == pytest.approx(pool, abs=0.02) and dec["alias_gib"] == pytest.approx(
        pool, abs=0.02
    )
    assert dec["temp_gib"] <= 2 * window + 1 / 32, dec  # measured 0.51 / 0.509 / 0.508 GiB (2026-12-06)
    assert pre["temp_gib"] <= {1: 1.7, 2: 1.9, 4: 2.01}[tensor], pre  # measured 1.611 / 1.877 / 2.0


def test_prefill_onto_context_through_splash_takes_one_group(kv_model):
    """The actor's prefill onto its cache (4 rows x 8,192 new tokens per chip, over the 16,384-token budget) runs
    splash, which holds no scores: one row group (``SamplerService.prefill_groups``), as the service runs it. In
    row groups each group's rows of the cache were copied for the kernel (the paper's 7B actor prefill on v5p-64
    at tensor 2: temp 12.8 GiB in 2 groups, 4.3 in one)."""
    _need_libtpu()
    args = ["--functions=prefill", "--rows=16", "--seq_len=32768", "--prompt_len=8192"]
    p, lines = _run([*_small(kv_model), *args])
    assert p.returncode == 0, p.stderr[-3000:]
    (ln,) = lines
    assert ln["attention"].endswith("splash") and ln["mesh"]["data"] == 4
    assert ln["shapes"]["prefill_groups"] == 1 and not ln["shapes"]["fresh"], ln["shapes"]
    assert ln["temp_gib"] <= 1.7, ln  # measured 1.689 GiB (2 groups: 1.744), 2026-12-06


def test_grouped_prefill_holds_no_second_cache(kv_model):
    """A prefill in row groups (the extractor's fresh prefill, 16 rows x 8,192 tokens over 4 chips: 2 groups at
    the 16,384-token budget per batch shard) reads the cache in its loop and writes every row's new keys once
    after it, so the TPU compiler's temporaries stay under the cache's size. The loop that carried the cache
    split as ``[L, r, groups, ...]`` (and the budget per mesh: 4 groups) held more than the cache (temp 1.205
    GiB against 0.892 here; the paper's extractor prefill on v5p-64, 64 rows x 16k: 26.0 against 12.5)."""
    _need_libtpu()
    args = ["--functions=extractor_prefill", "--rows=16", "--seq_len=32768", "--prompt_len=8192"]
    p, lines = _run([*_small(kv_model), *args])
    assert p.returncode == 0, p.stderr[-3000:]
    (ln,) = lines
    assert ln["shapes"]["prefill_groups"] == 2 and ln["mesh"]["data"] == 4 and ln["shapes"]["fresh"]
    cache = 2 * 4 * (16 // 4) * 32768 * 4 * 128 * 2 / 2**30  # K and V, bf16, per chip: 1 GiB
    assert ln["out_gib"] == pytest.approx(cache, abs=0.01) and ln["alias_gib"] == pytest.approx(
        cache, abs=0.01
    )
    assert ln["temp_gib"] <= cache, ln  # measured 0.892 GiB (2026-12-06)


def test_oversized_shape_reports_the_requested_size(tiny_model):
    """4,096 rows x 1M cache slots (256 GiB of KV cache per chip): the compiler refuses, the line says by how much."""
    _need_libtpu()
    p, lines = _run([*_small(tiny_model), "--functions=prefill", "--rows=4096", "--seq_len=1048576"])
    assert p.returncode == 0, p.stderr[-3000:]  # out of memory is a result, not a failure
    (ln,) = lines
    assert ln["function"] == "prefill" and ln["fits"] is False
    assert "RESOURCE_EXHAUSTED" in ln["error"]
    assert ln["requested_gib"] > ln["hbm_gib"] == V5P_HBM_GIB
    assert ln["requested_gib"] >= 256  # at least the per-chip KV cache
    assert ln["available_gib"] == V5P_HBM_GIB


def test_missing_libtpu_names_make_libtpu(tmp_path):
    if importlib.util.find_spec("libtpu") is not None:
        pytest.skip("libtpu is importable from this interpreter (a TPU host install)")
    p = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--config=configs/minihack_room.py",
            "--topology=v5p:2x2x1",
            f"--libtpu_dir={tmp_path}",
        ],
        cwd=REPO,
        env={**_env(), "PYTHONPATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert "make libtpu" in p.stderr


def test_parse_resource_exhausted():
    cc = _module()
    msg = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (277.72G) "
        "exceeds available HBM (95.74G)."
    )
    assert cc.parse_resource_exhausted(msg) == {"requested_gib": 277.72, "available_gib": 95.74}
    assert (
        cc.parse_resource_exhausted("... required (1.50T) exceeds available HBM (95.74G)")["requested_gib"]
        == 1536
    )
    other = "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 120.50G of 95.74G hbm."
    assert cc.parse_resource_exhausted(other) == {"requested_gib": 120.5, "available_gib": 95.74}
    assert cc.parse_resource_exhausted("something else") == {}
    assert cc.model_spec("Qwen/Qwen2.5-7B-Instruct") == "qwen2.5-7b-instruct"
    assert cc.parse_mesh("fsdp=16,tensor=2") == {"fsdp": 16, "tensor": 2}


def test_set_overrides_the_config_as_a_run_would():
    """``--set`` takes reproduce.py's ``--config.KEY=VALUE`` overrides (JSON values), validates, and names a bad
    key."""
    cc = _module()
    c = cc.load_config(
        os.path.join(REPO, "configs", "extractor_capacity.py"),
        ["config.extractor.rows_per_call=160", "mesh.extractor_tensor=2", "actor.dtype=float32"],
    )
    assert (c.extractor.rows_per_call, c.mesh.extractor_tensor, c.actor.dtype) == (160, 2, "float32")
    with pytest.raises(SystemExit, match="no config key"):
        cc.load_config(os.path.join(REPO, "configs", "minihack_room.py"), ["actor.nope.x=1"])
    with pytest.raises(ValueError, match="actor.dtype"):
        cc.load_config(os.path.join(REPO, "configs", "minihack_room.py"), ["actor.dtype=float8"])
