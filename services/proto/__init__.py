"""Python generated from ``protos/*.proto`` by ``make proto``; do not edit the ``*_pb2*`` files
(``tests/services/test_proto_current.py`` checks they match a fresh generation)."""
