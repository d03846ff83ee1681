"""Model specs in configs (``actor.model`` / ``extractor.model``) -> (ModelConfig, graphdef, params, tokenizer).

* ``"tiny"``: a random-init tiny Qwen3 decoder over a character-level SentencePiece vocabulary trained on the
  run's own prompt text (one token per map cell keeps grids aligned), cached in ``<workdir>/tokenizer`` so a
  resumed run reads the identical vocabulary.
* a local Hugging Face folder (``config.json`` + ``*.safetensors`` + ``tokenizer.json``): loaded sharded.
* anything else (a hub name like ``Qwen/Qwen2.5-7B-Instruct``): no hub is reachable from here, so a clear error
  says to download the folder and pass its path.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

from comprl_jax.models.config import ModelConfig
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


def tiny_tokenizer(corpus: Iterable[str], out_dir: str) -> Tokenizer:
    """BPE SentencePiece vocabulary for tiny models, trained once on the run's prompt text, cached in out_dir."""
    path = os.path.join(out_dir, "spm.model")
    if os.path.exists(path):
        return Tokenizer.from_sentencepiece(path)
    os.makedirs(out_dir, exist_ok=True)
    return Tokenizer.train_sentencepiece(
        list(corpus), TINY_VOCAB, out_dir, model_type="bpe", atomic_symbols=MAP_SYMBOLS
    )


def load_model(
    spec: str,
    *,
    role: str,
    tokenizer: Tokenizer | None,
    seed: int,
    mesh=None,
    tiny_overrides: dict | None = None,
) -> LoadedModel:
    """Builds one model by spec (see module docstring). ``tokenizer`` is required for ``"tiny"``."""
    if spec == "tiny":
        if tokenizer is None:
            raise ValueError(f"{role}.model='tiny' needs the run's tiny tokenizer")
        cfg = ModelConfig.tiny(
            "qwen3", vocab_size=tokenizer.vocab_size, max_position_embeddings=8192, **(tiny_overrides or {})
        )
        graphdef, params = init_decoder(cfg, seed=seed, mesh=mesh)
        return LoadedModel(cfg, graphdef, params, tokenizer)
    if os.path.isdir(spec):
        from comprl_jax.models.hf_io import load_hf

        cfg, graphdef, params = load_hf(spec, mesh=mesh)
        tok_path = os.path.join(spec, "tokenizer.json")
        return LoadedModel(cfg, graphdef, params, Tokenizer.from_hf_json(tok_path))
    raise ValueError(
        f"config key {role}.model={spec!r}: not 'tiny' and not a local folder. No model hub is reachable from "
        "this code: download the Hugging Face folder (config.json, *.safetensors, tokenizer.json) and pass its "
        f"path, e.g. --config.{role}.model=/models/{spec.split('/')[-1]}"
    )
