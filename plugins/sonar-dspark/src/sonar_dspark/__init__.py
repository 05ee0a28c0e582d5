"""DSpark speculation for Sonar: a DFlash backbone whose block is sampled left to right through a Markov head."""
