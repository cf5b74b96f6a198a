"""zeroinfer.ops: one public function per kernel family (being filled in)."""
