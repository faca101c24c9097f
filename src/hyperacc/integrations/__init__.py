"""Tracing from inside the trainers people use, for runs not started by ``hyperacc run``.

- ``hyperacc.integrations.hf.HyperaccCallback``: a ``transformers.TrainerCallback``;
- ``hyperacc.integrations.lightning.HyperaccCallback``: a ``lightning.Callback``.

Both install the same automatic tracing that ``hyperacc run`` installs (docs/tracing.md), in the
process, before the trainer wraps the model in DDP, and flush it when training ends.
"""
