"""Figure builders.

:mod:`.roofline` and :mod:`.paper` draw the SPEC section 6 models beside the
paper's numbers (SPEC section 7) and any measured result files; :mod:`.style`
holds the shared look.  Submodules import matplotlib, so nothing is imported
here: ``import nbattn.plots`` stays cheap.  The registry that names every
figure lives in :mod:`nbattn.figures`.
"""
