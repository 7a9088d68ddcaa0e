"""Generated stubs of the kvlease.v1 protos (proto/kvlease/v1/*.proto).

Do not edit: `python generate_stubs.py` rewrites them and
`python generate_stubs.py --check` tells whether they match the protos.
"""
