"""Token loops: plain AR and every speculative loop over image codes (Jacobi windows, drafter chains, ZipAR's
rows), the one verifier and its acceptance rules, the drafts they verify, and the compiled loop step."""
