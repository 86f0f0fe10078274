"""The wires the ranks talk over, besides loopback: `--link RATE`, an emulated link (one
network namespace per rank, a veth shaped by tc tbf, root needed: link.py), and `--link
model:RATE`, a modeled wire that costs the cores nothing (arrival times modeled, the bytes
through shared memory: wire.py, shared_wire.py); each with its sweep over rates
(link_sweep.py, wire_sweep.py)."""
