"""``python -m twin --render DIR [--stack NAME] [--stack-config FILE]``: the local twin of every RayService.

Exit 0 when every check passed, 1 when one failed, 2 for bad input (one line).
``python -m infra.twin --stack dev`` renders the stack and runs this.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from localserve.affinity_hang import AffinityHangBreaker
from twin.cluster import REPO, prepare_driver_env
from twin.render import TwinInputError, load_ray_services, model_names
from twin.report import Report
from twin.routing import router_specs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m twin", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--render", type=Path, required=True, help="a render directory (python -m infra.render)")
    parser.add_argument("--stack", help="the stack's name (prod adds the prod checks)")
    parser.add_argument("--stack-config", type=Path, help="the stack's Pulumi.<stack>.yaml, for the model names")
    parser.add_argument("--static-only", action="store_true", help="only the checks that start nothing")
    parser.add_argument("--keep", action="store_true", help="keep the local clusters' logs and files")
    parser.add_argument(
        "--monitoring",
        action="store_true",
        help="a real Prometheus on the first RayService: scrape, series, steady state, alert faults, panels",
    )
    return parser.parse_args(argv)


def _stop_on_sigterm(signum: int, _frame: object) -> None:
    # As Ctrl-C does: unwinds through every `finally`, which stops the local clusters.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """Runs the twin; see the module docstring for the exit codes."""
    # Before anything imports Ray: Ray reads these once, at import.
    prepare_driver_env()
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    args = parse_args(argv)
    workloads = str(REPO / "workloads")
    if workloads not in sys.path:
        sys.path.insert(0, workloads)
    try:
        services = load_ray_services(args.render)
        names = model_names(args.stack_config) if args.stack_config else None
        routers = router_specs(args.stack_config) if args.stack_config and not args.static_only else {}
    except TwinInputError as err:
        print(f"twin: {err}", file=sys.stderr)
        return 2
    report = Report()
    label = args.stack or str(args.render)
    report.note("", f"twin of {label}: {len(services)} RayService(s): {', '.join(s.name for s in services)}")
    model_dir = None
    if not args.static_only:
        from twin.model import tiny_model_dir

        model_dir = tiny_model_dir()
        report.step("", f"tiny model ready at {model_dir}")
    from twin.run import run_service

    # Short: Ray's unix sockets live under it and must stay below 108 bytes.
    work_root = Path(tempfile.mkdtemp(prefix="twin-", dir="/tmp"))
    from twin.prometheus import load_objects

    objects = load_objects(args.render) if args.monitoring else None
    breaker = AffinityHangBreaker(
        lambda killed: report.note("", killed.line()), on_stuck=lambda stuck: report.note("", stuck.line())
    ).start()
    for index, service in enumerate(services):
        if index == 0 and objects is not None and model_dir is not None and len(services) > 1:
            # Every RayService is scraped by the same monitors and read by the same rules; one proves them,
            # and the twin's minutes stay for the faults.
            report.note(
                "", f"monitoring: Prometheus and the alerts' faults run on the first RayService, {service.name}"
            )
        run_service(
            service,
            report,
            stack=args.stack,
            model_names=names,
            workdir=work_root / str(index),
            model_dir=model_dir,
            objects=objects if index == 0 and objects is not None else None,
            faults=index == 0,
            router=routers.get(service.name),
        )
    breaker.stop()
    verdict = "PASS" if report.ok_overall else "FAIL"
    report.note(
        "",
        f"{verdict} twin of {label}: {report.passed} checks passed, {len(report.failed)} failed, "
        f"{report.elapsed():.0f}s",
    )
    if not any(work_root.iterdir()):
        work_root.rmdir()
    elif args.keep or not report.ok_overall:
        report.note("", f"logs and files of the local clusters: {work_root}")
    else:
        shutil.rmtree(work_root, ignore_errors=True)
    return 0 if report.ok_overall else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("twin: interrupted; the local clusters are stopped", file=sys.stderr)
        sys.exit(130)
