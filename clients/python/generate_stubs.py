"""Generates the kvlease.v1 stubs under kvlease/v1/ from ../../proto, or
checks that the committed ones are what the protos give.

Usage:
    python generate_stubs.py          # (re)write kvlease/v1/*_pb2*.py(i)
    python generate_stubs.py --check  # exit 1, naming the files, when they differ

Needs grpcio-tools at GRPCIO_TOOLS (the version the committed stubs came
from: another version writes other version checks into them).
"""

import filecmp
import pathlib
import sys
import tempfile

GRPCIO_TOOLS = "1.85.1"
HERE = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent.parent / "proto"
PACKAGE = HERE / "kvlease" / "v1"


def generate(out: pathlib.Path) -> None:
    import grpc_tools
    from grpc_tools import protoc
    from importlib.metadata import version

    have = version("grpcio-tools")
    if have != GRPCIO_TOOLS:
        sys.exit(f"grpcio-tools {have} is installed; the stubs come from {GRPCIO_TOOLS}: "
                 f"pip install grpcio-tools=={GRPCIO_TOOLS}")
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "kvlease" / "v1").glob("*.proto"))
    if not protos:
        sys.exit(f"no .proto files under {PROTO_ROOT / 'kvlease' / 'v1'}")
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}", *protos]
    if protoc.main(args) != 0:
        sys.exit("protoc failed (see above)")


def stub_names(directory: pathlib.Path) -> set:
    return {p.name for p in directory.glob("*_pb2*.py*")}


def main() -> None:
    check = sys.argv[1:] == ["--check"]
    if sys.argv[1:] not in ([], ["--check"]):
        sys.exit(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        generate(out)
        fresh = out / "kvlease" / "v1"
        names = stub_names(fresh)
        if check:
            committed = stub_names(PACKAGE)
            differ = sorted(n for n in names & committed
                            if not filecmp.cmp(fresh / n, PACKAGE / n, shallow=False))
            missing = sorted(names - committed)
            extra = sorted(committed - names)
            if differ or missing or extra:
                print(f"kvlease/v1 stubs do not match {PROTO_ROOT}: differ {differ}, "
                      f"missing {missing}, not from a proto {extra}; run python generate_stubs.py")
                sys.exit(1)
            print(f"kvlease/v1: {len(names)} stub files match the protos")
            return
        for stale in stub_names(PACKAGE) - names:
            (PACKAGE / stale).unlink()
        for name in sorted(names):
            (PACKAGE / name).write_bytes((fresh / name).read_bytes())
        print(f"wrote {len(names)} stub files to {PACKAGE}")


if __name__ == "__main__":
    main()
