"""HiveJet: what a person or another program touches (GUI, HTTP server, CLI)."""
__version__ = "0.1.0"
