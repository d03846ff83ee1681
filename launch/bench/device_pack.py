"""What launch/bench/device_experiment.sh needs beside the working tree on a GPU machine that has no PyPI: MiniLM's
weights in half precision (the retriever; ~45 MB of the 64 MiB a device call may carry) in `.device/minilm_f16/`.

  python launch/bench/device_pack.py      # then: run(command="bash launch/bench/device_experiment.sh", carry=[".device"])
"""

import os
import shutil
import sys

import numpy as np
from safetensors.numpy import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from comprl_jax.models.embedders import minilm_dir  # noqa: E402

OUT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".device", "minilm_f16"
)


def main() -> None:
    src = minilm_dir()
    os.makedirs(OUT, exist_ok=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(os.path.join(src, name), os.path.join(OUT, name))
    weights = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v.astype(np.float16) for k, v in weights.items()}, os.path.join(OUT, "model.safetensors"))
    size = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    print(f"{OUT}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
