"""The DFlash drafter: its config and shape presets, the model and its block objective, the export in
the reference layout and its model card, teacher-forced evaluation, and speculative decoding.

May import: `target` (and the stages below it).
"""
