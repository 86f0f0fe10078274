"""The measuring harness behind `python -m tensor_parallel_toy profile`, one room per job.

    cli.py            the command: how its ranks run (a local pool, torchrun, the link)
    flags.py, spec.py its flags, checked, and the typed run every phase receives
    run/              running the modes: the phases on the ranks, the interleaved training,
                      its data, the Hugging Face mode, classic TP without SP for its memory,
                      and generation's cost per token (decode.py, a command of its own)
    measure/          measuring: memory and timing meters, the per-op overlap benchmark, the
                      timeline of one block, every transfer seen from outside, the memory model
    wires/            the wires the ranks talk over: an emulated link (network namespaces, a
                      shaped veth) and a modeled one (shared memory, arrival times), and the
                      sweeps over their rates
    report/           reporting: results.json's sections, the summary, the targets
                      (targets.json, data), the pictures, atomic files

Every room may read spec.py; between the rooms imports run one way, cli -> flags -> run -> wires ->
report -> measure (a room may skip those between), never back (tests/test_layout.py).
"""
