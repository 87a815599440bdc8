"""The library's version: a leaf module (imports nothing), read by ``setup.cfg``
(``attr:``), re-exported as ``hvdsparse.__version__`` and compared across ranks in the
settings fingerprint (:func:`hvdsparse.settings.fingerprint`)."""

__version__ = "0.1.0"
