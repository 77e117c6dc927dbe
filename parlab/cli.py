"""The ``parlab`` command.

    parlab doctor                     is this machine ready for the lectures?
    parlab bench NAME [--json] ...    measure on this machine; NAME is one of BENCHES

``python -m parlab`` is the same command.
"""

import argparse

from parlab import doctor
from parlab.bench import (
    async_sgd,
    collectives,
    compression,
    ddp,
    emulation,
    pipeline,
    plan,
    runtime,
    tensor_parallel,
    to_json,
    zero,
)

# A bench is a module of parlab.bench (see its docstring for what the module provides);
# registering it here is all the command line needs.
BENCHES = {
    "runtime": runtime,
    "collectives": collectives,
    "emulation": emulation,
    "ddp": ddp,
    "pipeline": pipeline,
    "zero": zero,
    "tensor_parallel": tensor_parallel,
    "compression": compression,
    "async": async_sgd,
    "plan": plan,
}


def main(argv=None):
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return its exit code.
    Bad input ends in argparse's usage message and ``SystemExit(2)``."""
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        return doctor.run()
    bench = BENCHES[args.bench]
    result = bench.run(args)
    print(to_json(result) if args.json else bench.format_report(result))
    return 0


def build_parser():
    parser = argparse.ArgumentParser(
        prog="parlab", description="parlab: parallel and distributed training, built from scratch."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("doctor", help="check that this machine is ready for the lectures")
    bench_parser = commands.add_parser("bench", help="measure parlab beside torch on this machine")
    benches = bench_parser.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, module in BENCHES.items():
        summary = module.__doc__.strip().splitlines()[0]
        bench = benches.add_parser(
            name, help=summary, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        bench.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
        module.add_arguments(bench)
    return parser
