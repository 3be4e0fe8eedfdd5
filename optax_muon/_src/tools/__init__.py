"""Tools that read any matrix optimizer through its report: ``summary``
(``summarize``) and ``diagnostics``."""
