"""``ShardsafeTrainer``: a ``transformers.Trainer`` whose checkpoints, ``save_model``, rotation, resume and
``push_to_hub`` go through shardsafe, under DDP and under DeepSpeed ZeRO-3.

Change one line of a training script (``Trainer`` -> ``ShardsafeTrainer``); the constructor and
``TrainingArguments`` are the Trainer's. The training math is not touched (the same seed gives the
same weights, bit for bit): only the methods that write, read or delete checkpoints and model
folders are overridden, and each does what the Trainer's does, collectively:

* ``output_dir/checkpoint-<step>`` is one shardsafe checkpoint (:func:`shardsafe.save`, committed
  atomically by the coordinator; every rank writes its own shard): the model (or, under ZeRO-3, the
  engine's partitions), optimizer, LR scheduler, grad scaler, every rank's RNG state, and the small
  files the Trainer reads back (see *trainer files* below). ``get_last_checkpoint`` and ``shardsafe
  inspect/verify/export`` work on these folders.
* Resume (``train(resume_from_checkpoint=True | path)``) restores all of that after
  ``accelerator.prepare``, in one read, and each rank's RNG state at the moment the Trainer
  restores its own (after skipping the batches already trained), so the following losses equal an
  uninterrupted run's.
* The train sampler is a :class:`shardsafe.data.ReshardableSampler` (the plain Trainer's batches at
  the same world size) whose global position is saved in each checkpoint, so a resume on another
  world size continues the data order, provided the global batch (per device x accumulation x world)
  is unchanged; another one is refused (:mod:`.data_order`).
* Rotation (``save_total_limit``) is done by the coordinator alone and never deletes the newest or
  the best checkpoint (also not at the end of training, where the Trainer would delete the newest
  when ``save_total_limit=1``); a checkpoint disappears by an atomic rename before its data is
  deleted, so a crash mid-deletion leaves no half checkpoint (``shardsafe gc`` removes the rest).
* ``save_model`` writes a Hugging Face model folder into ``output_dir`` (which may also hold
  checkpoints): the whole model, gathered one tensor at a time (under ZeRO-3 one module at a time),
  in the model's dtype; or, under ZeRO-3 with ``stage3_gather_16bit_weights_on_model_save: false``,
  no weights file at all but the model as a sharded shardsafe checkpoint in ``checkpoint/`` (fp32
  master weights; ``shardsafe export`` makes a weights file of it later). The new files appear with
  the weights marker (``model.safetensors`` / the index / ``checkpoint/``) last.
* ``push_to_hub`` uploads through :func:`shardsafe.push`, whose guard refuses missing, empty or
  dummy weights before anything is sent, in one Hub commit.

*Trainer files.* The Trainer reads ``trainer_state.json`` from the checkpoint folder on resume,
before anything else, and export reads ``config.json`` next to the weights. A shardsafe checkpoint
is committed atomically with exactly the files the save wrote, so these cannot be part of the
commit itself. They are stored instead *inside* the checkpoint, as text in its ``state.json``
(``trainer_files``: hashed and committed with the tensors, the source of truth), and written out
next to it as ordinary files by the coordinator after the commit (each atomically: temporary name,
fsync, rename). A crash between the commit and those writes leaves a complete checkpoint without
them, so before a resume the coordinator writes any that are missing from ``state.json`` again,
then every rank reads them. Nothing else reads them, so they can never disagree with the tensors
in a way that matters: a present file was written from the same ``state.json``.

DeepSpeed ZeRO-3 checkpoints go through ``shardsafe.state.deepspeed_engine`` (a live engine as a state value);
ZeRO-1/2 engines are refused with a clear error. Without a process group everything works on one
process.
"""

from shardsafe.integrations.transformers.checkpoints import (
    NoValidCheckpointError,
    checkpoint_steps,
    latest_checkpoint,
    rotate_checkpoints,
    write_trainer_files,
)
from shardsafe.integrations.transformers.model_folder import install_model_folder
from shardsafe.integrations.transformers.trainer import ShardsafeTrainer
from shardsafe.integrations.transformers.zero3 import zero3_gathered_tensors, zero3_sharded_model

__all__ = [
    "NoValidCheckpointError",
    "ShardsafeTrainer",
    "checkpoint_steps",
    "install_model_folder",
    "latest_checkpoint",
    "rotate_checkpoints",
    "write_trainer_files",
    "zero3_gathered_tensors",
    "zero3_sharded_model",
]
