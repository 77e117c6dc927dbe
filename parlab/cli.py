"""The ``parlab`` command.

    parlab grade [TOPIC[.TASK]] [--impl DIR]   grade your exercises (instructors: --json, --submissions)
    parlab hint TOPIC.TASK [--level L]         a hint for an exercise task
    parlab bench NAME [--json] ...             measure on this machine; NAME is one of BENCHES
    parlab doctor [--gpu]                      is this machine ready for the lectures (and its GPU)?

``python -m parlab`` is the same command. Grading's commands live in ``parlab.course.grade.command``.
"""

import argparse

from parlab.bench import (
    async_sgd,
    collectives,
    compression,
    context_parallel,
    ddp,
    diloco,
    emulation,
    experts,
    pipeline,
    plan,
    runtime,
    tensor_parallel,
    to_json,
    zero,
)
from parlab.course import doctor
from parlab.course.grade import command as grading

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
    "experts": experts,
    "context_parallel": context_parallel,
    "compression": compression,
    "async": async_sgd,
    "diloco": diloco,
    "plan": plan,
}


def main(argv=None):
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return its exit code.
    Bad input ends in argparse's usage message and ``SystemExit(2)``."""
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        return doctor.run(gpu=args.gpu)
    if args.command == "grade":
        return grading.run_grade(args)
    if args.command == "hint":
        return grading.run_hint(args)
    bench = BENCHES[args.bench]
    result = bench.run(args)
    print(to_json(result) if args.json else bench.format_report(result))
    return 0


def build_parser():
    parser = argparse.ArgumentParser(
        prog="parlab", description="parlab: parallel and distributed training, built from scratch."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    grade = commands.add_parser("grade", help=grading.GRADE_SUMMARY, description=grading.GRADE_SUMMARY)
    grading.add_grade_arguments(grade)
    hint = commands.add_parser("hint", help=grading.HINT_SUMMARY, description=grading.HINT_SUMMARY)
    grading.add_hint_arguments(hint)
    bench_parser = commands.add_parser("bench", help="Measure parlab beside torch on this machine.")
    doctor_parser = commands.add_parser("doctor", help="Check that this machine is ready for the lectures.")
    doctor_parser.add_argument("--gpu", action="store_true",
                               help="then the GPU check: every engine on the GPU against one process, and each "
                                    "lecture's bench with --device cuda (a few minutes; needs CUDA)")
    benches = bench_parser.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, module in BENCHES.items():
        bench = benches.add_parser(name, help=summary(module), description=module.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
        bench.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
        module.add_arguments(bench)
    return parser


def summary(module):
    """A bench's one-line help: the first paragraph of its docstring, a whole sentence."""
    return " ".join(module.__doc__.strip().split("\n\n")[0].split())
