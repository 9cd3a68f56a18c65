"""strategy of byteps-espresso."""
