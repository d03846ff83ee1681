"""Parity of our decoder with PyPI ``transformers`` (torch CPU) on random-weight tiny configs.

Each case builds a tiny HF model with random weights, ``save_pretrained``s it, loads it with ``load_hf`` and checks
fp32 logits over a right-padded batch (max |diff| <= 1e-4) and a 20-token greedy continuation through our
``extend`` (ragged prefill + decode steps) against HF ``generate`` row by row.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from comprl_jax.models import decoder as D  # noqa: E402
from comprl_jax.models.hf_io import load_hf  # noqa: E402

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
)  # fmt: skip
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64, "rope_theta": 500000.0,
}  # fmt: skip
CASES = {
    "qwen2-untied": ("Qwen2", dict(tie_word_embeddings=False)),
    "qwen2-tied": ("Qwen2", dict(tie_word_embeddings=True)),
    "qwen3-tied": ("Qwen3", dict(tie_word_embeddings=True)),
    "qwen3-untied": ("Qwen3", dict(tie_word_embeddings=False)),
    "llama3-rope": ("Llama", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
}
LENGTHS = [9, 5, 12]  # ragged rows, right-padded to 12
NEW = 20


def _hf_model(family: str, extra: dict, folder):
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{family}Config")(**TINY, **extra)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # larger-than-init weights: sharper logits, so greedy argmax has clear margins
        for name, p in model.named_parameters():
            if p.ndim == 2 or name.endswith("bias"):
                p.normal_(0.0, 0.15)
            else:
                p.uniform_(0.8, 1.2)  # norm weights: not all ones, so a missing norm would show
    model.save_pretrained(folder)
    return model


def _greedy(graphdef, params, cfg, prompts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    extend = jax.jit(D.extend, static_argnums=0)
    cache = D.init_cache(cfg, len(lengths), prompts.shape[1] + NEW)
    logits, cache = extend(graphdef, params, cache, jnp.asarray(prompts), jnp.asarray(lengths))
    tok = jnp.take_along_axis(logits, jnp.asarray(lengths - 1)[:, None, None], axis=1)[:, 0].argmax(-1)
    out = [tok]
    ones = jnp.ones(len(lengths), jnp.int32)
    for _ in range(NEW - 1):
        logits, cache = extend(graphdef, params, cache, tok[:, None].astype(jnp.int32), ones)
        tok = logits[:, 0].argmax(-1)
        out.append(tok)
    return np.stack([np.asarray(t) for t in out], axis=1)


@pytest.mark.parametrize("case", list(CASES))
def test_hf_parity(case, tmp_path):
    family, extra = CASES[case]
    hf = _hf_model(family, extra, tmp_path)
    cfg, graphdef, params = load_hf(str(tmp_path))
    assert cfg.tie_word_embeddings == extra["tie_word_embeddings"]
    rng = np.random.default_rng(0)
    b, t = len(LENGTHS), max(LENGTHS)
    lengths = np.array(LENGTHS, np.int32)
    mask = np.arange(t)[None] < lengths[:, None]
    tokens = np.where(mask, rng.integers(0, TINY["vocab_size"], (b, t)), 0).astype(np.int32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))

    ours = np.asarray(jax.jit(D.forward, static_argnums=0)(graphdef, params, tokens, positions, mask))
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64))
        ).logits.numpy()
    diff = np.abs(ours - ref)[mask].max()
    assert diff <= 1e-4, f"max |logit diff| {diff:.2e} on valid tokens"

    got = _greedy(graphdef, params, cfg, tokens, lengths)
    for i, n in enumerate(LENGTHS):
        with torch.no_grad():
            want = hf.generate(
                torch.tensor(tokens[i : i + 1, :n]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                pad_token_id=0, eos_token_id=None,
            )[0, n:].numpy()  # fmt: skip
        np.testing.assert_array_equal(
            got[i], want, err_msg=f"row {i} (prompt length {n}) greedy continuation"
        )
