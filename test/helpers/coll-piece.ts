// A collective piece's header for the wire tests, well formed: a test changes one thing of it.
import { CollPhase, type encodeCollPiece } from "../../schemas/messages/trainer.ts";

/** The header of the first piece rank 1 sends rank 0 in the reduce-scatter of an all-reduce. */
export function pieceFromOne(job: string, generation: number): Parameters<typeof encodeCollPiece>[0] {
  return {
    job,
    generation,
    group: "#all-reduce",
    from: 1,
    to: 0,
    step: 0,
    bucket: 0,
    phase: CollPhase.ReduceScatter,
    hop: 0,
    piece: 0,
    offset: 0,
    reason: "",
  };
}
