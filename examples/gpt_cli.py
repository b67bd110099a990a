"""Train the byte-level GPT of ``examples/gpt.py`` with :class:`jaxlight.cli.LightningCLI`.

Every setting comes from config files and the command line, as with Lightning's CLI:

    python examples/gpt_cli.py fit --config examples/gpt_cli.yaml
    python examples/gpt_cli.py fit --config examples/gpt_cli.yaml --trainer.max_steps 100 --model.lr 1e-3
    python examples/gpt_cli.py fit --config examples/gpt_cli.yaml --print_config   # the merged config
    python examples/gpt_cli.py fit --help                                          # every option
    python examples/gpt_cli.py validate --config examples/gpt_cli.yaml --ckpt_path last

Several processes (here 2 x 4 simulated CPU devices, FSDP inside a process, data parallel across):

    jaxlight launch --nprocs 2 --devices-per-process 4 examples/gpt_cli.py fit \\
        --config examples/gpt_cli.yaml --config examples/clusters/hybrid.yaml

``--data.seq_len`` also sets the model's context length, and ``--trainer.max_steps`` the length
of its learning-rate schedule (``link_arguments``). The config actually run is saved next to the
metrics as ``config.yaml``; ``--config`` on that file repeats the run.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.gpt import GPT, StdlibText
from jaxlight.cli import LightningCLI


class GPTCLI(LightningCLI):
    """LightningCLI for the GPT: the model's context length and schedule follow the data and the trainer."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.seq_len", "model.seq_len")
        parser.link_arguments("trainer.max_steps", "model.max_steps")


def main(args: list[str] | None = None, **kwargs) -> GPTCLI:
    """Run the command line ``args`` (``sys.argv[1:]`` when None); returns the CLI (``cli.trainer``, ``cli.model``)."""
    return GPTCLI(GPT, StdlibText, args=args, **kwargs)


if __name__ == "__main__":
    main()
