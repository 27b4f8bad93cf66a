// The parser the metrics test reads scrapes with (it ships no types of its own).
declare module "parse-prometheus-text-format" {
  export default function parse(text: string): unknown[];
}
