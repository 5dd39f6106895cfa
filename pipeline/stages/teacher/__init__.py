"""Stage 1: DP-SGD fine-tuning of the teacher on the private records, with Opacus 1.6.

    recipe.py      train_teacher: setup, one step, checkpoint, save (the stage's entry point)
    trainable.py   what is trained: full, bitfit or LoRA
    monitor.py     the published validation loss and when a step publishes a time
    state.py       what a training holds while it runs (Run) and what it returns
    checkpoint.py  the private resume checkpoint (crash-safe budget)
    ddp.py         torchrun: the data-parallel ranks and the nodes that join them

The DP-SGD mechanics they use (samplers, σ, clipping modes) are pipeline/privacy/dpsgd.py.
Nothing is imported here, so that ddp.py (which a joining node runs) stays free of the stage.
"""
