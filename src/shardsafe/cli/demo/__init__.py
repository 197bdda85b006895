"""``shardsafe demo``: a sharded training run under :class:`~shardsafe.CheckpointManager`, preempted,
crashed, resumed twice, its checkpoint resharded and checked.

The modules, in the order the data flows:

* :mod:`.settings` - the options, the schedule of the preemption and the crash, shared constants;
* :mod:`.model` - the tiny GPT and its byte-level corpus (built the same way by the ranks and by the
  single-process evaluation);
* :mod:`.worker` - one rank of the training run (``python -m shardsafe.cli.demo.worker ...``, started
  by ``torch.distributed.run`` on N CPU ranks with gloo): it trains under FSDP2 and saves through a
  ``CheckpointManager`` (async saves every K steps, ``keep_last=3``, ``keep_best=1`` by held-out
  loss, ``handle_preemption=True``), resuming with ``manager.restore``; when told to, it simulates
  a preemption (rank 0 sends SIGTERM to every rank's process after a given step, as a scheduler
  would; the manager makes all ranks write a final checkpoint at that step boundary and the run
  exits cleanly) or a hard crash (every rank SIGKILLs itself after a given step);
* :mod:`.run` - the orchestrator behind ``shardsafe demo``: it launches the run three times
  (preempted, crashed, finished), reloads the final checkpoint into one plain process (no process
  group), verifies it and lists what retention kept;
* :mod:`.summary` - turns the three runs' event logs into the numbers of ``summary.json`` and the
  printed summary.

The worker's rank 0 records everything the summary needs as JSON lines in
``<out>/logs/events.jsonl``, flushed line by line, so a SIGKILL loses nothing written before it.
Nothing is imported here, so ``python -m shardsafe.cli.demo.worker`` runs its module only once.
"""

__all__: list[str] = []
