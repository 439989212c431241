"""The model and what it trains with: ``module.py`` (LitModel, the LightningModule around any network),
``objectives.py`` (classification, flow matching, diffusion), ``ema.py`` (the weight average), ``sampling.py``
(images from a generative objective), ``judge.py`` (what scores them) and ``nets/`` (small reference networks)."""
