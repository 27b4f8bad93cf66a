import { MeshtrainError } from "../../ffi/errors.ts";
// A data file that is missing, unreadable or malformed. The message names the file and what
// is wrong with it, and says what to do where we know.
export class DataFileError extends MeshtrainError {
  override readonly name = "DataFileError";
  constructor(
    readonly file: string,
    readonly reason: string,
    options?: { cause?: unknown },
  ) {
    super(`${file}: ${reason}`, options);
  }
}
