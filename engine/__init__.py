"""HiveJet's inference engine: turns requests into tokens. Knows models, not pixels or HTTP."""
