"""The ``hyperacc`` command line. Each subcommand lives in ``hyperacc.commands.<name>`` and is imported
only when it runs, so ``hyperacc theory`` does not pay for importing torch.

Exit status: 0 done, 1 the command could not do its work (the message says why), 2 bad input (one
line naming the option and what is allowed), 130 interrupted (docs/reliability.md)."""

from __future__ import annotations

import importlib
import sys

import click

from hyperacc.commands.params import OneLineErrors

# name -> (module:attribute, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "theory": ("hyperacc.commands.theory:command", "Spike theory: cluster spike probability, required rates, MTBF."),
    "run": ("hyperacc.commands.run:command", "Run a training script through torchrun with hyper-trace on."),
    "analyze": ("hyperacc.commands.analyze:command", "Diagnose a run directory: stragglers, spikes, causes."),
    "report": ("hyperacc.commands.report:command", "Write a self-contained HTML report of a run directory."),
    "compare": ("hyperacc.commands.compare:command", "Compare runs side by side; exit 1 when a --fail-on limit breaks."),
    "export": ("hyperacc.commands.export:command", "Export a run directory as a Chrome/Perfetto trace."),
    "import-kineto": ("hyperacc.commands.import_kineto:command", "Import torch.profiler traces and analyse them."),
    "affinity": ("hyperacc.commands.affinity:command", "Show the NUMA/CPU binding plan for this node."),
    "simulate": ("hyperacc.commands.simulate:command", "Simulate bulk-synchronous training at scale."),
    "watch": ("hyperacc.commands.watch:command", "Show the live view of a running job from its run directory."),
    "doctor": ("hyperacc.commands.doctor:command", "Pre-flight check of every rank, node and link; hosts to leave out."),
}


class LazyGroup(OneLineErrors, click.Group):
    """Subcommands imported when they run; every usage error of any of them is one line, exit 2."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        target, _ = COMMANDS[name]
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hyperacc")
def cli() -> None:
    """hyperacc: fast and predictable synchronous distributed PyTorch training."""


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="hyperacc", standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
