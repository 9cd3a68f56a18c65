"""server of byteps-espresso."""
