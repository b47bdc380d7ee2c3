"""Rules that need whole matrices (Muon): their leaf (``leaf``), each matrix to its home rank and back
(``matrix_exchange``), the choice of homes (``homes``) and Newton-Schulz over tensor-parallel blocks
(``tensor_parallel_newton_schulz``)."""
