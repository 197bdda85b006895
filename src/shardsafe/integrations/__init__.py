"""Integrations with training frameworks (each module imports its framework; import the one you use).

``shardsafe.integrations.transformers.ShardsafeTrainer``: a drop-in ``transformers.Trainer`` whose
checkpoints, ``save_model``, rotation, resume and ``push_to_hub`` go through shardsafe.
"""

__all__: list[str] = []
