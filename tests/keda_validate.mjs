// Validates KEDA manifests against KEDA's own CRD schemas, as packaged in
// @kubernetes-models/keda (generated from KEDA's CustomResourceDefinitions); `make
// keda-schema` installs it. Usage: node keda_validate.mjs FILE.yaml...; prints one line per
// document, exits 1 if any ScaledObject or TriggerAuthentication is invalid.
import { readFileSync } from "node:fs";
import yaml from "js-yaml";
import { ScaledObject, TriggerAuthentication } from "@kubernetes-models/keda/keda.sh/v1alpha1";

const kinds = { ScaledObject, TriggerAuthentication };
let numInvalid = 0;
for (const file of process.argv.slice(2)) {
  for (const doc of yaml.loadAll(readFileSync(file, "utf8"))) {
    if (!doc) continue;
    const Model = kinds[doc.kind];
    if (!Model) {
      console.log(`${file}: ${doc.kind}: not a kind checked here`);
      continue;
    }
    try {
      new Model(doc).validate();
      console.log(`${file}: ${doc.kind} ${doc.metadata?.name}: valid`);
    } catch (err) {
      numInvalid++;
      console.log(`${file}: ${doc.kind} ${doc.metadata?.name}: ${err.message}`);
    }
  }
}
process.exit(numInvalid ? 1 : 0);
