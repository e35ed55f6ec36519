"""Figure builders.

:mod:`.roofline` and :mod:`.paper` draw the performance models beside the
paper's reported numbers and any measured result files; :mod:`.style`
holds the shared look.  Submodules import matplotlib, so nothing is imported
here: ``import nbattn.plots`` stays cheap.  The registry that names every
figure lives in :mod:`nbattn.figures`.
"""
